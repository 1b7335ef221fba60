import sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from gptoss_jax.kernels import gpu, triton
which = sys.argv[1]
E, M = 32, 2048
sizes = jnp.asarray(np.full(E, M // E, np.int32))
x = jax.random.normal(jax.random.key(0), (M, 2880), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (E, 2880, 2880), jnp.bfloat16) * 0.02
if which == "mosaic64":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    y = ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, block_m=64, block_n=64, block_k=64, max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True)
elif which == "matvec":
    y = triton.pair_matvec(x[:4], jnp.array([1, 5, 9, 30]), w)
    x = x[:4]; sizes = None
ref = jnp.einsum("md,mfd->mf", x, w[jnp.repeat(jnp.arange(E), M // E)] if sizes is not None else w[jnp.array([1,5,9,30])], preferred_element_type=jnp.float32)
print(which, "ok", float(jnp.abs(y.astype(jnp.float32) - ref).max() / jnp.abs(ref).max()))
