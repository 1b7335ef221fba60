"""The kernels one by one at gpt-oss-20b's shapes on one GPU: each checked against the jnp
reference, then timed. Prints a table last.

    python bench/kernels.py [--part attention|ragged|decode|tiles|tiles-prompt|decode64|experts64|matvec|matvec-mxfp4|grouped-mxfp4|decode-attention|decode-attention-paged|decode-experts|decode-experts-16bit|layout]
        [--pairs 4,256] [--profile DIR]

With --profile, `python bench/profile_summary.py DIR/<row's profile> --steps 30` gives a row's GPU
time per call without the host's dispatch (tens of microseconds in the "ms" column).

Needs a GPU, and tokamax for its kernels (pip install -e ".[cuda]").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax.kernels.attention import flash
from gptoss_jax.kernels.experts import ragged as ragged_dots
from gptoss_jax.kernels.attention import xla
from gptoss_jax.kernels.combine import combine
from gptoss_jax.kernels.triton.attention import cache_attention
from gptoss_jax.kernels.triton.matvec import pair_matvec

K, G, H, D, F2, E = 8, 8, 64, 2880, 5760, 32
ROWS = []
PAIRS = None  # --pairs: the pair counts the expert parts run (all of theirs by default)
PROFILE = None  # --profile DIR: each row's timed calls traced into DIR/<row number> (bench/profile_summary.py)
MOSAIC_ONLY = False  # --mosaic-only: grouped-mxfp4 without the Pallas Triton and transposed variants
PAGED = ((256, 1536), (1024, 1536), (1024, 512))  # --paged: decode-attention-paged's (sequences, filled) cases
PAGED_BLOCKS = (None, 64, 128, 256)  # --paged-blocks: its key blocks (None: the kernel's default)
PAGED_RUNS = 30  # --paged-runs: the timed calls of each of its rows (the median is reported)


def pair_counts(default):
    return tuple(p for p in default if PAIRS is None or p in PAIRS)


def timed(name, fn, *args, n=20, ref=None, check=None, **extra):
    f = jax.jit(fn)
    try:
        out = jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001 -- a variant that does not run is a row of the table
        ROWS.append({"op": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(ROWS[-1], flush=True)
        return None
    times = []
    trace = (jax.profiler.trace(os.path.join(PROFILE, f"{len(ROWS):03d}")) if PROFILE
             else contextlib.nullcontext())
    with trace:
        for _ in range(n):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t)
    row = {"op": name, "ms": round(1e3 * float(np.median(times)), 3), **extra}
    if PROFILE:
        row["profile"] = f"{len(ROWS):03d}"
    if ref is not None:
        a = np.asarray(check(out) if check else out, np.float32)
        b = np.asarray(ref, np.float32)
        row["rel_err"] = float(np.abs(a - b).max() / np.abs(b).max())
    ROWS.append(row)
    print(row, flush=True)
    return out


def attention():
    key = jax.random.key(0)
    kq, kk, kv, ks = jax.random.split(key, 4)
    for T, window in ((4096, None), (4096, 128)):
        q = jax.random.normal(kq, (1, T, K, G, H), jnp.bfloat16)
        k = jax.random.normal(kk, (1, T, K, H), jnp.bfloat16)
        v = jax.random.normal(kv, (1, T, K, H), jnp.bfloat16)
        sinks = jax.random.normal(ks, (K, G), jnp.float32)
        pos = jnp.arange(T)[None]
        ref = jax.jit(lambda q, k, v, s: combine([xla.dense(q, k, v, xla.visible(pos, pos, window))], s, jnp.float32))(
            q, k, v, sinks)
        flops = 4 * T * T * K * G * H / (2 if window is None else T / window)
        tag = f"attention causal T={T} window={window}"
        for name, fn in (("xla blockwise", lambda q, k, v, s: combine([xla.causal(q, k, v, window=window, block=512)],
                                                                      s, q.dtype)),
                         ("tokamax", lambda q, k, v, s: combine([flash.causal(q, k, v, window=window)], s, q.dtype))):
            timed(f"{tag} {name}", fn, q, k, v, sinks, ref=ref, flops=flops)
    S = 4224
    for B, T in ((1, 1), (64, 1), (1, 512), (8, 512)):
        q = jax.random.normal(kq, (B, T, K, G, H), jnp.bfloat16)
        k = jax.random.normal(kk, (B, S, K, H), jnp.bfloat16)
        v = jax.random.normal(kv, (B, S, K, H), jnp.bfloat16)
        sinks = jax.random.normal(ks, (K, G), jnp.float32)
        kv_len = jnp.full((B,), 4100 if T == 1 else 3584, jnp.int32)
        mask = jnp.broadcast_to((jnp.arange(S)[None] < kv_len[:, None])[:, None], (B, T, S))
        ref = jax.jit(lambda q, k, v, s: combine([xla.dense(q, k, v, mask)], s, jnp.float32))(q, k, v, sinks)
        tag = f"attention prefix B={B} T={T} S={S}"
        kv_bytes = 2 * B * int(kv_len[0]) * K * H * 2
        for name, fn in (("xla", lambda q, k, v, s: combine([xla.prefix(q, k, v, kv_len, block=512)], s, q.dtype)),
                         ("tokamax", lambda q, k, v, s: combine([flash.prefix(q, k, v, kv_len)], s, q.dtype))):
            timed(f"{tag} {name}", fn, q, k, v, sinks, ref=ref, kv_bytes=kv_bytes)


def ragged(rng):
    import tokamax
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    w = jax.random.normal(jax.random.key(1), (E, F2, D), jnp.bfloat16) * 0.02  # [E, out, in] as the model holds
    wt = jnp.swapaxes(w, 1, 2)  # [E, in, out]: tokamax's preferred layout
    for M, experts in ((4, 4), (32, 32), (256, 32), (2048, 32), (16384, 32)):
        chosen = rng.choice(E, size=experts, replace=False)
        sizes = np.zeros(E, np.int32)
        np.add.at(sizes, rng.choice(chosen, size=M - experts), 1)
        sizes[chosen] += 1
        sizes = jnp.asarray(sizes)
        x = jax.random.normal(jax.random.key(2), (M, D), jnp.bfloat16)
        groups = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=M)
        ref = jax.jit(lambda x, w: jnp.einsum("md,mfd->mf", x, w[groups], preferred_element_type=jnp.float32))(x, w) \
            if M <= 256 else None
        bytes_read = experts * F2 * D * 2
        tag = f"ragged M={M} experts={experts}"
        timed(f"{tag} tokamax [E,F,D]", lambda x, w: ragged_dots.ragged_dot(x, w, sizes), x, w, ref=ref, weight_bytes=bytes_read)
        timed(f"{tag} tokamax [E,D,F]", lambda x, wt: tokamax.ragged_dot(x, wt, sizes, implementation="mosaic"),
              x, wt, ref=ref, weight_bytes=bytes_read)
        timed(f"{tag} jax mgpu transpose_rhs", lambda x, w: ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=sizes, block_m=64 if M > 64 else 64, block_n=128, block_k=64, max_concurrent_steps=4,
            grid_block_n=1, transpose_rhs=True), x, w, ref=ref, weight_bytes=bytes_read)
        if M <= 256:
            timed(f"{tag} triton pair matvec", lambda x, w: pair_matvec(x, groups, w), x, w, ref=ref,
                  weight_bytes=bytes_read)
            timed(f"{tag} xla gather", lambda x, w: jnp.einsum("md,mfd->mf", x, w[groups]), x, w, ref=ref,
                  weight_bytes=bytes_read)


def tiles(rng, rows=(256, 2048, 16384)):
    """The Mosaic GPU ragged dot's tile shapes for both expert projections, against tokamax; and the
    un-sorting of the per-pair outputs (a scatter, or a gather fused into the weighted sum)."""
    import tokamax
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    for F in (F2, D):
        w = jax.random.normal(jax.random.key(1), (E, F, D), jnp.bfloat16) * 0.02
        wt = jnp.swapaxes(w, 1, 2)
        for M in rows:
            sizes = np.zeros(E, np.int32)
            np.add.at(sizes, rng.choice(E, size=M), 1)
            sizes = jnp.asarray(sizes)
            x = jax.random.normal(jax.random.key(2), (M, D), jnp.bfloat16)
            groups = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=M)
            ref = jax.jit(lambda x, w: jax.lax.fori_loop(0, E, lambda e, acc: acc + jnp.where(
                (groups == e)[:, None], jnp.einsum("md,fd->mf", x, w[e], preferred_element_type=jnp.float32), 0),
                jnp.zeros((M, F), jnp.float32)))(x, w)
            tag = f"tiles [{E},{F},{D}] M={M}"
            flops = 2 * M * F * D
            timed(f"{tag} tokamax [E,F,D]", lambda x, w: ragged_dots.ragged_dot(x, w, sizes), x, w, ref=ref, flops=flops)
            timed(f"{tag} tokamax [E,D,F]", lambda x, wt: tokamax.ragged_dot(x, wt, sizes, implementation="mosaic"),
                  x, wt, ref=ref, flops=flops)
            configs = [(bm, bn, steps, gbn) for bm in (64, 128) for bn in (64, 128, 192, 256)
                       for steps, gbn in ((4, 1), (4, 2))]
            if M > 1024:  # prompts: around the best of the above
                configs += [(128, 192, steps, gbn) for steps, gbn in ((4, 4), (4, 8), (3, 2), (5, 2), (6, 2))]
            for bm, bn, steps, gbn in configs:
                if F % bn:
                    continue
                timed(f"{tag} mgpu m={bm} n={bn} steps={steps} gbn={gbn}",
                      lambda x, w: ragged_dot_mgpu.ragged_dot(
                          x, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                          grid_block_n=gbn, transpose_rhs=True),
                      x, w, ref=ref, flops=flops)
    N, A = 4096, 4
    y = jax.random.normal(jax.random.key(4), (N * A, D), jnp.bfloat16)
    order = jnp.asarray(rng.permutation(N * A))
    weights = jax.random.uniform(jax.random.key(5), (N, A))
    inv = jnp.argsort(order)
    ref = jnp.einsum("nad,na->nd", jnp.zeros_like(y).at[order].set(y).reshape(N, A, D).astype(jnp.float32), weights)
    timed("unsort scatter + einsum", lambda y, o, wt: jnp.einsum(
        "nad,na->nd", jnp.zeros_like(y).at[o].set(y).reshape(N, A, D).astype(jnp.float32), wt),
        y, order, weights, ref=ref)
    timed("unsort gather + weighted sum", lambda y, i, wt: (
        y[i].reshape(N, A, D).astype(jnp.float32) * wt[..., None]).sum(1), y, inv, weights, ref=ref)
    timed("inverse permutation: argsort", jnp.argsort, order)
    timed("inverse permutation: scatter iota", lambda o: jnp.zeros_like(o).at[o].set(jnp.arange(o.size)), order)
    idx = jnp.asarray(rng.integers(0, E, (N, A)), jnp.int32)
    timed("sort pairs: stable argsort", lambda i: jnp.argsort(i.reshape(-1), stable=True), idx)


def _decode_attention_case(B, S, filled):
    """One decode query per sequence over a bf16 cache of S slots, `filled` of them in use: (q, k, v,
    sinks, kv_len, the float32 jnp reference, the K/V bytes a kernel must read)."""
    kq, kk, kv, ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (B, 1, K, G, H), jnp.bfloat16)
    k = jax.random.normal(kk, (B, S, K, H), jnp.bfloat16)
    v = jax.random.normal(kv, (B, S, K, H), jnp.bfloat16)
    sinks = jax.random.normal(ks, (K, G), jnp.float32)
    kv_len = jnp.full((B,), filled, jnp.int32)
    mask = jnp.broadcast_to((jnp.arange(S)[None] < kv_len[:, None])[:, None], (B, 1, S))
    ref = jax.jit(lambda q, k, v, s: combine([xla.dense(q, k, v, mask)], s, jnp.float32))(q, k, v, sinks)
    return q, k, v, sinks, kv_len, ref, 2 * B * filled * K * H * 2


def experts64(rng):
    """Decode batch 64's experts (256 pairs over 32 experts): the ragged dot over expert-sorted rows,
    where an expert whose rows straddle two row tiles has its weights read twice, against a batched
    product over [E, 64, D] slots (each expert's rows in its own slot, every weight read once)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    N, A = 64, 4
    idx = jnp.asarray(np.stack([rng.choice(E, size=A, replace=False) for _ in range(N)]), jnp.int32)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E)
    # Each pair's slot within its expert: its rank among the expert's pairs.
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(N * A) - (jnp.cumsum(sizes) - sizes)[flat[order]])
    for F in (F2, D):
        w = jax.random.normal(jax.random.key(1), (E, F, D), jnp.bfloat16) * 0.02
        x = jax.random.normal(jax.random.key(2), (N * A, D), jnp.bfloat16)  # pair rows, in pair order
        ref = jnp.einsum("pd,pfd->pf", x, w[flat], preferred_element_type=jnp.float32)
        tag = f"experts b64 [{E},{F},{D}]"
        timed(f"{tag} mosaic ragged dot (chosen tiles)",
              lambda x, w: ragged_dots.mosaic_ragged_dot(x[order], w, sizes)[jnp.argsort(order)], x, w, ref=ref,
              weight_bytes=E * F * D * 2)
        for bm in (64, 128):
            timed(f"{tag} mosaic ragged dot m={bm} n=192",
                  lambda x, w: ragged_dot_mgpu.ragged_dot(
                      x[order], w, group_sizes=sizes, block_m=bm, block_n=192, block_k=64, max_concurrent_steps=4,
                      grid_block_n=1, transpose_rhs=True)[jnp.argsort(order)], x, w, ref=ref,
                  weight_bytes=E * F * D * 2)

        def slots(x, w):
            xs = jnp.zeros((E, N, D), x.dtype).at[flat, rank].set(x)
            return jnp.einsum("emd,efd->emf", xs, w)[flat, rank]

        timed(f"{tag} batched product over [E, 64, D] slots", slots, x, w, ref=ref, weight_bytes=E * F * D * 2)


def matvec(rng):
    """The decode expert matvec at batch 1 (4 pairs): block shapes and splits, timed as 8 layers' calls
    in one jitted function (so the host's dispatch is not in the figure)."""
    L, P = 8, 4
    for F in (F2, D):
        ws = [jax.random.normal(jax.random.key(10 + i), (E, F, D), jnp.bfloat16) * 0.02 for i in range(L)]
        idx = jnp.asarray(rng.choice(E, size=P, replace=False), jnp.int32)
        x = jax.random.normal(jax.random.key(2), (P, D), jnp.bfloat16)
        ref = jnp.stack([jnp.einsum("pd,pfd->pf", x, w[idx], preferred_element_type=jnp.float32) for w in ws])
        # Triton blocks are powers of two and D = 2880 = 64 x 45, so block_d stays 64.
        configs = [(bf, 64, w, st, sp) for bf, w, st, sp in (
            (64, 4, 3, None), (64, 4, 3, 1), (64, 4, 3, 5), (64, 4, 3, 9), (64, 8, 3, None), (64, 4, 5, None),
            (128, 4, 3, None), (128, 8, 3, None), (128, 8, 4, 1), (128, 8, 4, 3), (256, 8, 3, None),
            (256, 8, 3, 1), (32, 4, 3, None), (32, 2, 4, None), (32, 4, 3, 1), (16, 2, 4, None), (16, 2, 4, 1))]
        for bf, bd, warps, stages, splits in configs:
            if F % bf:
                continue
            timed(f"matvec x{L} layers [{E},{F},{D}] P={P} bf={bf} bd={bd} warps={warps} stages={stages} "
                  f"splits={splits}",
                  lambda x, *ws: jnp.stack([pair_matvec(x, idx, w, block_f=bf, block_d=bd, num_warps=warps,
                                                        num_stages=stages, splits=splits) for w in ws]),
                  x, *ws, ref=ref, weight_bytes=L * P * F * D * 2, n=30)


def _packed_layers(L, F):
    """L layers' random MXFP4 experts [E, F, D] as (blocks, scales), scales 2^-9 to 2^-4."""
    packed = []
    for i in range(L):
        kb, ks = jax.random.split(jax.random.key(20 + i))
        packed.append((jax.random.randint(kb, (E, F, D // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8),
                       jax.random.randint(ks, (E, F, D // 32), 118, 124, jnp.int32).astype(jnp.uint8)))
    return packed


def matvec_mxfp4(rng):
    """The decode expert matvec over MXFP4-packed experts at batch 1 (4 pairs), 8 layers' calls per
    jitted function, against decoding first; bytes read are the packed blocks and scales."""
    from gptoss_jax.kernels.triton.mxfp4 import pair_matvec_mxfp4
    from gptoss_jax.mxfp4 import decode

    L, P = 8, 4
    for F in (F2, D):
        packed = _packed_layers(L, F)
        idx = jnp.asarray(rng.choice(E, size=P, replace=False), jnp.int32)
        x = jax.random.normal(jax.random.key(2), (P, D), jnp.bfloat16)
        ref = jnp.stack([jnp.einsum("pd,pfd->pf", x, decode(b, s)[idx], preferred_element_type=jnp.float32)
                         for b, s in packed])
        nbytes = L * P * F * (D // 2 + D // 32)
        args = [a for pair in packed for a in pair]
        for bf, warps, decoder in ((2, 4, "jnp"), (4, 4, "jnp"), (2, 4, "ptx"), (4, 4, "ptx"), (4, 2, "ptx"),
                                   (4, 8, "ptx"), (8, 4, "ptx"), (8, 8, "ptx"), (16, 8, "ptx")):
            timed(f"mxfp4 matvec x{L} layers [{E},{F},{D}] P={P} bf={bf} warps={warps} {decoder}",
                  lambda x, *a: jnp.stack([pair_matvec_mxfp4(x, idx, a[2 * i], a[2 * i + 1], block_f=bf,
                                                             num_warps=warps, decoder=decoder)
                                           for i in range(L)]),
                  x, *args, ref=ref, weight_bytes=nbytes, n=30)


def decode_experts(rng):
    """Decode-sized expert products (--part decode-experts) over MXFP4-packed experts (4, 32, 64 and
    256 pairs: batches 1, 8, 16 and 64), 8 layers' calls per jitted function: the Pallas Triton
    kernels the decode path uses (the per-pair matvec; the grouped matmul at 256
    pairs) against the Pallas Mosaic GPU grouped matmul with decode's settings (blocks of 64, split
    steps), its grouping of the pairs included."""
    from gptoss_jax.kernels.experts import mosaic_decode, mosaic_mxfp4, mosaic_pair
    from gptoss_jax.kernels.triton.mxfp4 import grouped_matmul_mxfp4, pair_matvec_mxfp4
    from gptoss_jax.kernels.pairs import decode_block, to_blocks
    from gptoss_jax.mxfp4 import decode

    L = 8
    for F in (F2, D):
        packed = _packed_layers(L, F)
        args = [a for pair in packed for a in pair]
        for P in pair_counts((4, 32, 64, 256)):
            idx = jnp.asarray(np.stack([rng.choice(E, 4, replace=False) for _ in range(P // 4)]), jnp.int32)
            flat = idx.reshape(-1)
            x = jax.random.normal(jax.random.key(2), (P // 4, D), jnp.bfloat16)
            xp = jnp.repeat(x, 4, axis=0)  # each pair's input
            ref = jnp.stack([jnp.einsum("pd,pfd->pf", xp, decode(b, s)[flat], preferred_element_type=jnp.float32)
                             for b, s in packed])
            experts_read = len(set(np.asarray(flat).tolist()))
            nbytes = L * experts_read * F * (D // 2 + D // 32)
            tag = f"mxfp4 x{L} layers [{E},{F},{D}] pairs={P}"
            if P <= 64:
                timed(f"{tag} triton pair matvec", lambda x, *a: jnp.stack(
                    [pair_matvec_mxfp4(x, flat, a[2 * i], a[2 * i + 1]) for i in range(L)]),
                    xp, *args, ref=ref, weight_bytes=nbytes, n=30)
            else:
                def triton_grouped(x, *a):
                    rows, undo, be, used = to_blocks(x, idx, E, 16)
                    return jnp.stack([undo(grouped_matmul_mxfp4(rows, be, used, a[2 * i], a[2 * i + 1], block_m=16,
                                                                block_n=64, num_warps=4, num_stages=3)).reshape(P, F)
                                      for i in range(L)])

                timed(f"{tag} triton grouped block=16", triton_grouped, x, *args, ref=ref, weight_bytes=nbytes, n=30)
            bound = to_blocks(x, idx, E, 64)[2].shape[0]
            settings = mosaic_mxfp4.decode_settings(bound, F, D // 32)

            def mosaic(x, *a):
                rows, undo, be, used = to_blocks(x, idx, E, 64)
                return jnp.stack([undo(mosaic_mxfp4.grouped_matmul_mxfp4(rows, be, used, a[2 * i], a[2 * i + 1],
                                                                          **settings)).reshape(P, F)
                                  for i in range(L)])

            timed(f"{tag} mosaic grouped, blocks of 64 {settings}", mosaic, x, *args, ref=ref, weight_bytes=nbytes, n=30)
            G = D // 32
            if P == 4:  # one token: a row per pair, no tensor cores (kernels/experts/mosaic_pair.py)
                pair_default = mosaic_pair.pair_settings(G)
                for pair_settings in (pair_default, {**pair_default, "splits": 15}, {**pair_default, "splits": 3},
                                      {**pair_default, "splits": 1}, {**pair_default, "block_f": 128},
                                      {**pair_default, "decoder": "jnp"}):
                    def pair_rows(x, *a, settings=pair_settings):
                        return jnp.stack([mosaic_pair.pair_matvec_mxfp4(x, flat, a[2 * i], a[2 * i + 1], **settings)
                                          for i in range(L)])

                    timed(f"{tag} mosaic pair {pair_settings}", pair_rows, xp, *args, ref=ref, weight_bytes=nbytes,
                          n=30)
            block = decode_block(P, E)
            bound = to_blocks(x, idx, E, block)[2].shape[0]
            default = mosaic_decode.decode_settings_mxfp4(bound, F, G, block_m=block)
            for blk, settings in ((block, default), (block, {**default, "weights": "smem"}),
                                  (block, {**default, "decoder": "jnp"}),
                                  (block, {**default, "stages": 4}),
                                  (block, mosaic_decode.decode_settings_mxfp4(bound, F, G, block_m=block, block_f=128)),
                                  (block, mosaic_decode.decode_settings_mxfp4(bound, F, G, gs=2)),
                                  (block, mosaic_decode.decode_settings_mxfp4(bound, F, G, gs=3)),
                                  (2 * block, mosaic_decode.decode_settings_mxfp4(bound, F, G, block_m=2 * block))):
                def swapped(x, *a, blk=blk, settings=settings):
                    rows, undo, be, used = to_blocks(x, idx, E, blk)
                    return jnp.stack([undo(mosaic_decode.grouped_matvec_mxfp4(rows, be, used, a[2 * i], a[2 * i + 1],
                                                                               block_m=blk, **settings)).reshape(P, F)
                                      for i in range(L)])

                timed(f"{tag} mosaic decode block={blk} {settings}", swapped, x, *args, ref=ref, weight_bytes=nbytes,
                      n=30)


def decode_experts_16bit(rng):
    """Decode-sized expert products over bf16 experts (4, 32, 64 and 256 pairs), 8 layers' calls per
    jitted function: the Pallas Triton per-pair matvec and, at 256 pairs, the Mosaic GPU ragged dot
    (the previous defaults) against the Pallas Mosaic GPU decode kernel (products transposed, blocks
    of 8 to 16 rows), its grouping of the pairs included, with variants of its settings."""
    from gptoss_jax.kernels.experts import mosaic_decode
    from gptoss_jax.kernels.pairs import decode_block, pair_inputs, sort_by_expert, to_blocks, unsort

    L = 8
    for F in (F2, D):
        ws = [jax.random.normal(jax.random.key(40 + i), (E, F, D), jnp.bfloat16) * 0.02 for i in range(L)]
        for P in pair_counts((4, 32, 64, 256)):
            idx = jnp.asarray(np.stack([rng.choice(E, 4, replace=False) for _ in range(P // 4)]), jnp.int32)
            flat = idx.reshape(-1)
            x = jax.random.normal(jax.random.key(2), (P // 4, D), jnp.bfloat16)
            xp = jnp.repeat(x, 4, axis=0)
            ref = jnp.stack([jnp.einsum("pd,pfd->pf", xp, w[flat], preferred_element_type=jnp.float32) for w in ws])
            nbytes = L * len(set(np.asarray(flat).tolist())) * F * D * 2
            tag = f"bf16 x{L} layers [{E},{F},{D}] pairs={P}"
            if P <= 64:
                timed(f"{tag} triton pair matvec", lambda x, *w: jnp.stack([pair_matvec(x, flat, wi) for wi in w]),
                      xp, *ws, ref=ref, weight_bytes=nbytes, n=30)
            else:
                def ragged(x, *w):
                    order, _, sizes = sort_by_expert(idx, E)
                    rows = pair_inputs(x, order, 4)
                    return jnp.stack([unsort(ragged_dots.mosaic_ragged_dot(rows, wi, sizes), order) for wi in w])

                timed(f"{tag} mosaic ragged dot", ragged, x, *ws, ref=ref, weight_bytes=nbytes, n=30)
            block = decode_block(P, E)
            bound = to_blocks(x, idx, E, block)[2].shape[0]
            default = mosaic_decode.decode_settings(bound, F, D)
            variants = [(block, default), (block, {**default, "stages": 6}), (block, {**default, "stages": 3}),
                        (block, mosaic_decode.decode_settings(bound, F, D, block_f=64)),
                        (block, mosaic_decode.decode_settings(bound, F, D, block_f=256)),
                        (block, {**default, "splits": 1}), (2 * block, default)]
            for blk, settings in variants:
                def mosaic(x, *w, blk=blk, settings=settings):
                    rows, undo, be, used = to_blocks(x, idx, E, blk)
                    return jnp.stack([undo(mosaic_decode.grouped_matvec(rows, be, used, wi, block_m=blk, **settings)
                                           ).reshape(P, F) for wi in w])

                timed(f"{tag} mosaic decode block={blk} {settings}", mosaic, x, *ws, ref=ref, weight_bytes=nbytes,
                      n=30)
        del ws


def _expert_blocks(x, idx, block):
    """The pairs' rows x [P, D] (one per (token, expert) pair of idx [N, A]) in expert blocks of
    `block` rows: (rows [blocks * block, D], dest (each sorted pair's row), block_expert, used)."""
    from gptoss_jax.kernels.pairs import group_by_expert

    order, dest, block_expert, used = group_by_expert(idx, E, block)
    rows = jnp.zeros((block_expert.shape[0] * block, D), x.dtype).at[dest].set(x[order], mode="drop")
    return rows, dest, block_expert, used


def grouped_mxfp4(rng):
    """Experts over MXFP4-packed weights at a 4096-token prompt (16,384 pairs) and at a decode batch of
    64 (256 pairs): the Triton grouped matmul's settings against the bf16 weights' Mosaic GPU ragged
    dot and against decoding the layer first (what packed prompts did before)."""
    from gptoss_jax.kernels.triton.mxfp4 import grouped_matmul_mxfp4
    from gptoss_jax.mxfp4 import decode

    for F, name in ((F2, "mlp1"), (D, "mlp2")):
        kb, ks = jax.random.split(jax.random.key(30))
        blocks = jax.random.randint(kb, (E, F, D // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jax.random.randint(ks, (E, F, D // 32), 118, 124, jnp.int32).astype(jnp.uint8)
        w = decode(blocks, scales)  # bf16 [E, F, D]
        for pairs in pair_counts((16384, 4096, 1024, 256)):
            idx = jnp.asarray(rng.integers(0, E, (pairs // 4, 4)), jnp.int32)
            flat = np.asarray(idx).reshape(-1)
            sizes = jnp.asarray(np.bincount(flat, minlength=E), jnp.int32)
            x = jax.random.normal(jax.random.key(3), (pairs, D), jnp.bfloat16)
            xs = x[np.argsort(flat, kind="stable")]
            flops = 2 * pairs * F * D
            tag = f"{name} [{E},{F},{D}] pairs={pairs}"
            ref = timed(f"{tag} bf16 weights, mosaic ragged dot", lambda x, w: ragged_dots.mosaic_ragged_dot(x, w, sizes),
                        xs, w, flops=flops)
            timed(f"{tag} decode layer + mosaic ragged dot",
                  lambda x, b, s: ragged_dots.mosaic_ragged_dot(x, decode(b, s), sizes), xs, blocks, scales, ref=ref,
                  flops=flops)
            prompt = ((128, 128, 8, 3, "ptx"), (128, 128, 4, 2, "ptx"), (128, 128, 4, 3, "jnp"),
                      (256, 128, 8, 2, "ptx"), (256, 128, 4, 2, "ptx"), (64, 128, 4, 3, "ptx"))
            batch = ((16, 64, 4, 3, "ptx"), (16, 64, 4, 3, "jnp"), (16, 32, 4, 3, "ptx"), (16, 64, 4, 2, "ptx"),
                     (32, 64, 4, 3, "ptx"))
            if pairs > 256:
                from gptoss_jax.kernels.experts import mosaic_mxfp4
                mosaic_variants = ((128, 256, 2, 4, "ptx"), (128, 128, 4, 3, "ptx"), (128, 256, 2, 3, "ptx"),
                                   (256, 128, 2, 3, "ptx"), (192, 128, 2, 4, "ptx"))
                if not MOSAIC_ONLY:
                    mosaic_variants += ((128, 256, 2, 4, "jnp"),)
                for block, bn, gs, stages, decoder in mosaic_variants:
                    rows, dest, block_expert, used = _expert_blocks(x, idx, block)
                    timed(f"{tag} mosaic grouped block={block} bn={bn} gs={gs} stages={stages} {decoder}",
                          lambda r, b, s: mosaic_mxfp4.grouped_matmul_mxfp4(
                              r, block_expert, used, b, s, block_m=block, block_n=bn, gs=gs, stages=stages,
                              decoder=decoder)[dest],
                          rows, blocks, scales, ref=ref, flops=flops)
                if MOSAIC_ONLY:
                    continue
                from gptoss_jax.kernels.experts import mosaic_decode
                for block, bf, gs in ((64, 256, 3), (128, 128, 3), (128, 256, 2), (128, 256, 3), (64, 128, 6)):
                    rows, dest, block_expert, used = _expert_blocks(x, idx, block)
                    timed(f"{tag} mosaic transposed, weights from registers, block={block} block_f={bf} gs={gs}",
                          lambda r, b, s: mosaic_decode.grouped_matvec_mxfp4(
                              r, block_expert, used, b, s, block_m=block, block_f=bf, gs=gs)[dest],
                          rows, blocks, scales, ref=ref, flops=flops)
            for block, bn, warps, stages, decoder in (prompt if pairs > 256 else batch):
                rows, dest, block_expert, used = _expert_blocks(x, idx, block)
                timed(f"{tag} triton grouped block={block} bn={bn} warps={warps} stages={stages} {decoder}",
                      lambda r, b, s: grouped_matmul_mxfp4(r, block_expert, used, b, s, block_m=block, block_n=bn,
                                                           num_warps=warps, num_stages=stages, decoder=decoder)[dest],
                      rows, blocks, scales, ref=ref, flops=flops)


def epilogue(rng):
    """The MXFP4 prompt kernel's epilogue at a 4096-token prompt (16,384 pairs over 32 experts, blocks
    of 128): mlp1 with its bias and SwiGLU applied by XLA after the kernel (the kernel's [rows, 5760]
    output written and read back) against both in the kernel's epilogue ([rows, 2880] written);
    mlp2 with its bias added by XLA against in the epilogue."""
    from gptoss_jax.kernels.experts import mosaic_mxfp4
    from gptoss_jax.model.moe import SwiGLU

    pairs = 16384
    idx = jnp.asarray(rng.integers(0, E, (pairs // 4, 4)), jnp.int32)
    x = jax.random.normal(jax.random.key(3), (pairs, D), jnp.bfloat16)
    rows, dest, block_expert, used = _expert_blocks(x, idx, 128)
    nb = block_expert.shape[0]
    for F, name, act in ((F2, "mlp1", SwiGLU(1.702, 7.0)), (D, "mlp2", None)):
        kb, ks = jax.random.split(jax.random.key(30))
        blocks = jax.random.randint(kb, (E, F, D // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jax.random.randint(ks, (E, F, D // 32), 118, 124, jnp.int32).astype(jnp.uint8)
        bias = jax.random.uniform(jax.random.key(5), (E, F), jnp.float32, -2, 2).astype(jnp.bfloat16)

        def after(r, b, s, bias):
            out = mosaic_mxfp4.grouped_matmul_mxfp4(r, block_expert, used, b, s)
            out = (out.reshape(nb, 128, -1) + bias[block_expert][:, None]).reshape(nb * 128, -1)
            return (out if act is None else act(out))[dest]  # the pairs' rows

        tag = f"epilogue {name} [{E},{F},{D}] pairs={pairs}"
        ref = timed(f"{tag}: bias{' and SwiGLU' if act else ''} by XLA after the kernel", after, rows, blocks,
                    scales, bias, flops=2 * pairs * F * D)
        timed(f"{tag}: in the kernel's epilogue",
              lambda r, b, s, bias: mosaic_mxfp4.grouped_matmul_mxfp4(r, block_expert, used, b, s, bias,
                                                                      swiglu=act)[dest],
              rows, blocks, scales, bias, ref=ref, flops=2 * pairs * F * D)


def layout(rng):
    """A 4096-token prompt's 16,384 pairs laid out in expert blocks of 128 rows (pairs.to_blocks,
    as the MXFP4 prompt kernel takes them), over 32 and 128 experts: the rows gathered from the
    inputs (the model's) against the sorted pairs' rows scattered into the blocks (before)."""
    from gptoss_jax.kernels.pairs import group_by_expert, pair_inputs, to_blocks

    N, A = 4096, 4
    x = jax.random.normal(jax.random.key(7), (N, D), jnp.bfloat16)
    for experts in (32, 128):
        idx = jnp.asarray(np.stack([rng.choice(experts, A, replace=False) for _ in range(N)]), jnp.int32)

        def scattered(x, idx, count=experts):
            order, dest, block_expert, _ = group_by_expert(idx, count, 128)
            return jnp.zeros((block_expert.shape[0] * 128, D), x.dtype).at[dest].set(pair_inputs(x, order, A),
                                                                                       mode="drop")

        ref = jax.jit(scattered)(x, idx)
        timed(f"layout E={experts}: rows gathered (to_blocks)", lambda x, i: to_blocks(x, i, experts, 128)[0], x, idx,
              ref=ref)
        timed(f"layout E={experts}: rows scattered", scattered, x, idx, ref=ref)


def decode64():
    """Decode attention at batch 64 over a 4100-token cache: the Triton kernel's settings."""
    q, k, v, sinks, kv_len, ref, kv_bytes = _decode_attention_case(64, 4224, 4100)
    for splits in (None, 1, 4):
        for bk in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    if splits is not None and (warps, stages) != (4, 2):
                        continue
                    timed(f"decode attention B=64 splits={splits} block={bk} warps={warps} stages={stages}",
                          lambda q, k, v, s: combine([cache_attention(q, k, v, kv_len, splits=splits, block_k=bk,
                                                                      num_warps=warps, num_stages=stages)], s, q.dtype),
                          q, k, v, sinks, ref=ref, kv_bytes=kv_bytes, n=50)


def decode_attention():
    """Decode attention to a cache (filled part only): the Pallas Mosaic GPU kernel's settings against
    the Pallas Triton kernel's default and the jnp pass over the whole cache."""
    from gptoss_jax.kernels.attention import mosaic_cache

    for B, S, filled in ((1, 4224, 4100), (1, 4224, 256), (8, 4224, 4100), (64, 4224, 4100), (1, 32896, 32800),
                         (16, 32896, 32800)):
        q, k, v, sinks, kv_len, ref, kv_bytes = _decode_attention_case(B, S, filled)
        tag = f"decode attention B={B} S={S} filled={filled}"
        timed(f"{tag} xla dense", lambda q, k, v, s: combine([xla.prefix(q, k, v, kv_len, block=512)], s, q.dtype),
              q, k, v, sinks, ref=ref, kv_bytes=kv_bytes, n=50)
        timed(f"{tag} triton", lambda q, k, v, s: combine([cache_attention(q, k, v, kv_len)], s, q.dtype),
              q, k, v, sinks, ref=ref, kv_bytes=kv_bytes, n=50)
        for bk, splits in ((None, None), (64, None), (128, None), (256, None), (128, 4)):
            timed(f"{tag} mosaic block={bk} splits={splits}", lambda q, k, v, s: combine(
                [mosaic_cache.cache_attention(q, k, v, kv_len, block_k=bk, splits=splits)], s, q.dtype),
                q, k, v, sinks, ref=ref, kv_bytes=kv_bytes, n=50)


def decode_attention_paged():
    """The serving engine's decode attention at many sequences (one full-attention layer's paged pool,
    pages of 64, each sequence `filled` positions of a 2,048-position table): the Pallas Mosaic GPU
    kernel over the pool in bfloat16 and in FP8 storage (fp8.py), at the bytes each must read."""
    from gptoss_jax import fp8
    from gptoss_jax.kernels.attention import mosaic_cache, paged

    P, W = 64, 32
    for B, filled in PAGED:
        kq, kk, kv, ks, kp = jax.random.split(jax.random.key(4), 5)
        q = jax.random.normal(kq, (B, 1, K, G, H), jnp.bfloat16)
        sinks = jax.random.normal(ks, (K, G), jnp.float32)
        table = jax.random.permutation(kp, B * W).reshape(B, W).astype(jnp.int32)
        kv_len = jnp.full((B,), filled, jnp.int32)
        pools = {"bf16": tuple(jax.random.normal(key, (B * W, P, K, H), jnp.bfloat16) for key in (kk, kv))}
        pools["fp8"] = tuple(jax.jit(fp8.quantize)(x) for x in pools["bf16"])
        ref = jax.jit(lambda q, k, v, s: combine([paged.prefix(q, k, v, table, kv_len, block=512)], s, jnp.float32))(
            q, *(fp8.read(x, jnp.bfloat16) for x in pools["fp8"]), sinks)
        for name, (pk, pv) in pools.items():
            for bk in PAGED_BLOCKS:
                timed(f"paged decode attention B={B} filled={filled} mosaic {name} block={bk}",
                      lambda q, k, v, s: combine([mosaic_cache.cache_attention(q, k, v, kv_len, table=table, block_k=bk)],
                                                 s, q.dtype),
                      q, pk, pv, sinks, ref=ref if name == "fp8" else None,
                      kv_bytes=2 * B * filled * K * fp8.vector_bytes(H, fp8.KV_DTYPES[name]), n=PAGED_RUNS)


def decode(rng):
    """Decode attention to a cache (filled part only) and the decode expert matvec, with variants."""
    for B, S, filled in ((1, 4224, 4100), (1, 4224, 256), (8, 4224, 4100), (64, 4224, 4100), (1, 32896, 32800),
                         (16, 32896, 32800)):
        q, k, v, sinks, kv_len, ref, kv_bytes = _decode_attention_case(B, S, filled)
        tag = f"decode attention B={B} S={S} filled={filled}"
        timed(f"{tag} xla dense", lambda q, k, v, s: combine([xla.prefix(q, k, v, kv_len, block=512)], s, q.dtype),
              q, k, v, sinks, ref=ref, kv_bytes=kv_bytes)
        for splits in (None, 8, 32):
            for bk, warps in ((64, 4), (128, 4), (128, 8)):
                if splits is not None and (bk, warps) != (64, 4):
                    continue
                timed(f"{tag} triton splits={splits} block={bk} warps={warps}", lambda q, k, v, s: combine(
                    [cache_attention(q, k, v, kv_len, splits=splits, block_k=bk, num_warps=warps)], s, q.dtype),
                    q, k, v, sinks, ref=ref, kv_bytes=kv_bytes)
    for F, Din in ((F2, D), (D, D)):
        w = jax.random.normal(jax.random.key(1), (E, F, Din), jnp.bfloat16) * 0.02
        for M in (4, 32):
            groups = jnp.asarray(rng.choice(E, size=M, replace=M > E))
            x = jax.random.normal(jax.random.key(2), (M, Din), jnp.bfloat16)
            ref = jax.jit(lambda x, w: jnp.einsum("md,mfd->mf", x, w[groups], preferred_element_type=jnp.float32))(x, w)
            bytes_read = M * F * Din * 2
            for bf, bd, warps, stages in ((64, 64, 4, 3), (32, 64, 4, 4), (16, 64, 2, 4), (64, 64, 8, 4),
                                          (128, 64, 8, 3), (32, 64, 2, 6)):
                timed(f"matvec [{E},{F},{Din}] M={M} bf={bf} bd={bd} warps={warps} stages={stages}",
                      lambda x, w: pair_matvec(x, groups, w, block_f=bf, block_d=bd, num_warps=warps,
                                               num_stages=stages), x, w, ref=ref, weight_bytes=bytes_read)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["all", "attention", "ragged", "decode", "tiles", "tiles-prompt", "decode64", "experts64", "matvec", "matvec-mxfp4", "grouped-mxfp4", "decode-attention", "decode-attention-paged", "decode-experts", "decode-experts-16bit", "layout", "epilogue"], default="all")
    ap.add_argument("--profile", metavar="DIR", help="trace each row's timed calls into DIR/<row number>, for "
                    "bench/profile_summary.py (GPU time without the host's dispatch)")
    ap.add_argument("--pairs", default=None,
                    help="comma-separated (token, expert) pair counts for the expert parts (e.g. 4,256)")
    ap.add_argument("--mosaic-only", action="store_true",
                    help="grouped-mxfp4: only the bf16 ragged dot and the Pallas Mosaic GPU kernel's variants")
    ap.add_argument("--paged", default=None, metavar="B:FILLED,...",
                    help="decode-attention-paged: its cases, sequences:filled positions (default "
                         "256:1536,1024:1536,1024:512)")
    ap.add_argument("--paged-blocks", default=None, metavar="N,...",
                    help="decode-attention-paged: key blocks to time, 'default' for the kernel's own (default: "
                         "default,64,128,256)")
    ap.add_argument("--paged-runs", type=int, default=30, help="decode-attention-paged: timed calls a row")
    args = ap.parse_args()
    global PAIRS, PROFILE, MOSAIC_ONLY, PAGED, PAGED_BLOCKS, PAGED_RUNS
    if args.paged:
        PAGED = tuple(tuple(int(x) for x in case.split(":")) for case in args.paged.split(","))
    if args.paged_blocks:
        PAGED_BLOCKS = tuple(None if b == "default" else int(b) for b in args.paged_blocks.split(","))
    PAGED_RUNS = args.paged_runs
    MOSAIC_ONLY = args.mosaic_only
    PAIRS = None if args.pairs is None else {int(p) for p in args.pairs.split(",")}
    PROFILE = args.profile
    rng = np.random.default_rng(0)
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    if args.part in ("all", "attention"):
        attention()
    if args.part in ("all", "ragged"):
        ragged(rng)
    if args.part in ("all", "decode"):
        decode(rng)
    if args.part in ("all", "tiles"):
        tiles(rng)
    if args.part == "decode64":
        decode64()
    if args.part == "decode-attention":
        decode_attention()
    if args.part == "decode-attention-paged":
        decode_attention_paged()
    if args.part == "decode-experts":
        decode_experts(rng)
    if args.part == "decode-experts-16bit":
        decode_experts_16bit(rng)
    if args.part == "matvec-mxfp4":
        matvec_mxfp4(rng)
    if args.part == "grouped-mxfp4":
        grouped_mxfp4(rng)
    if args.part == "epilogue":
        epilogue(rng)
    if args.part == "matvec":
        matvec(rng)
    if args.part == "experts64":
        experts64(rng)
    if args.part == "tiles-prompt":
        tiles(rng, rows=(16384,))
    if args.part == "layout":
        layout(rng)
    print("\n| op | ms | rel err | note |\n|---|---:|---:|---|")
    for r in ROWS:
        note = r.get("error") or ", ".join(f"{k}={v:.3g}" for k, v in r.items() if k not in ("op", "ms", "rel_err"))
        if "flops" in r:
            note = f"{r['flops'] / r['ms'] / 1e9:.0f} TFLOP/s"
        for key in ("kv_bytes", "weight_bytes"):
            if key in r:
                note = f"{r[key] / r['ms'] / 1e6:.0f} GB/s"
        print(f"| {r['op']} | {r.get('ms', '-')} | {r.get('rel_err', float('nan')):.2g} | {note} |")
    print(json.dumps(ROWS))


if __name__ == "__main__":
    main()
