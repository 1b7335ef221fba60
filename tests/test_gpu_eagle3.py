"""An EAGLE-3 head through the GPU's attention kernels (`pytest -m gpu`, as tests/test_gpu.py): a
prompt chunk (tokamax's flash attention over the cache's prefix), then a checked step's pairs and
single drafting positions (the Mosaic GPU decode kernel, which reads a sequence's filled positions
only), in bfloat16, against the same head in float32 on the jnp path within NOISE_FACTOR x the jnp
path's own bfloat16 noise. The float32 jnp head is itself checked against the float64 reference on
CPU (tests/test_eagle3.py); its error is far below bfloat16's, so it stands as the exact side."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax.model.eagle3 import Eagle3Head, init_head_cache
from gptoss_jax.eagle3_config import Eagle3Config
from noise import Exact

pytestmark = pytest.mark.gpu

# gpt-oss heads' attention (64 query heads over 8 KV heads of 64), narrow elsewhere.
HEAD = Eagle3Config(hidden_size=256, intermediate_size=512, vocab_size=1024, draft_vocab_size=128,
                    target_hidden_size=256, aux_layers=(0, 1, 2))


@pytest.fixture(scope="module", autouse=True)
def _on_gpu():
    assert jax.default_backend() == "gpu", "these tests need an NVIDIA GPU"


def run(kernels, dtype, params, calls, max_len=256):
    """The head over `calls` (embedded, hidden, valid) one after the other on one cache -> logits of each."""
    apply = jax.jit(Eagle3Head(HEAD, param_dtype=dtype, kernels=kernels).apply)  # compiled once a call shape
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    cache, out = init_head_cache(HEAD, 2, max_len, dtype), []
    for embedded, hidden, valid in calls:
        logits, _, cache = apply(params, embedded.astype(dtype), hidden.astype(dtype), cache, valid)
        out.append(np.asarray(logits, np.float32))
    return out


def test_a_head_on_the_gpu_kernels_computes_what_the_jnp_path_computes():
    auto, jnp_path = gj.Kernels(), gj.Kernels(attention="blockwise")
    assert auto.attention_for(40) == "tokamax" and auto.attention_for(4) == "mosaic"  # the kernels under test
    rng = np.random.default_rng(0)
    G, D = len(HEAD.aux_layers) * HEAD.target_hidden_size, HEAD.hidden_size
    calls = []
    for T, width, n_valid in ((40, G, (40, 33)), (4, G, (4, 2)), (1, D, (1, 1)), (1, D, (1, 0))):
        valid = jnp.asarray(np.arange(T)[None] < np.array(n_valid)[:, None])  # a prefix of each row
        calls.append((jnp.asarray(rng.normal(size=(2, T, D)), jnp.float32),
                      jnp.asarray(rng.normal(size=(2, T, width)) * 2, jnp.float32), valid))
    params = Eagle3Head(HEAD, param_dtype=jnp.float32).init(jax.random.key(0), *calls[0][:2],
                                                            init_head_cache(HEAD, 2, 256, jnp.float32), calls[0][2])
    exact = run(jnp_path, jnp.float32, params, calls)
    low = run(jnp_path, jnp.bfloat16, params, calls)
    got = run(auto, jnp.bfloat16, params, calls)
    for i, (_, _, valid) in enumerate(calls):
        rows = np.asarray(valid)  # padding positions' logits are never read
        Exact.measure(low[i][rows], exact[i][rows], precision="bfloat16").check(got[i][rows], f"call {i}")


def test_the_head_on_the_gpu_kernels_reads_no_position_past_a_sequence():
    """Cache slots past each sequence's length hold huge keys and values: a drafting pass that read
    them would show it; it gives what it gives over a clean cache."""
    rng = np.random.default_rng(1)
    G, D = len(HEAD.aux_layers) * HEAD.target_hidden_size, HEAD.hidden_size
    head = Eagle3Head(HEAD, param_dtype=jnp.bfloat16, kernels=gj.Kernels())
    first = (jnp.asarray(rng.normal(size=(2, 12, D)), jnp.bfloat16),
             jnp.asarray(rng.normal(size=(2, 12, G)), jnp.bfloat16),
             jnp.asarray(np.arange(12)[None] < np.array([[12], [5]])))
    params = head.init(jax.random.key(1), *first[:2], init_head_cache(HEAD, 2, 128, jnp.bfloat16), first[2])
    apply = jax.jit(head.apply)
    _, _, cache = apply(params, *first[:2], init_head_cache(HEAD, 2, 128, jnp.bfloat16), first[2])
    beyond = (jnp.arange(128)[None] >= cache["lengths"][:, None])[..., None, None]
    filled = {**cache, "k": jnp.where(beyond, 3e4, cache["k"]).astype(jnp.bfloat16),
              "v": jnp.where(beyond, -3e4, cache["v"]).astype(jnp.bfloat16)}
    step = (jnp.asarray(rng.normal(size=(2, 1, D)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(2, 1, D)), jnp.bfloat16), jnp.ones((2, 1), bool))
    clean = apply(params, *step[:2], cache, step[2])[0]
    np.testing.assert_array_equal(np.asarray(apply(params, *step[:2], filled, step[2])[0]), np.asarray(clean))
