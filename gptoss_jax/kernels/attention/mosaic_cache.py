"""Decode attention to a KV cache in Pallas Mosaic GPU (NVIDIA Hopper, JAX >= 0.11): the contract of
the readable `xla.prefix` for decode-sized queries, reading only each sequence's filled positions.

A program holds the T * G query rows of one sequence and one KV head (padded to 64, the rows of one
wgmma), and walks a range of that sequence's filled key blocks: the TMA engine brings each block's
keys and values ([block_k, H] each) into shared memory, two blocks deep, while the tensor cores
score the block before (wgmma, float32 sums) and the warpgroup keeps a running max, sum and output
in registers. The ranges are the filled blocks split evenly over `splits` programs per (sequence,
KV head), counted on the device from kv_len, so a batch of one still fills the GPU and no program
reads a slot past its sequence's length (beyond the last block's tail). combine.fold_splits folds
the ranges' partial results by their log-sum-exp.

Over a paged cache (paged_cache.py: pools of pages [N, P, K, H] and a page table [B, W]), a block of
keys is `block_k / P` whole pages, each brought in by a TMA copy of its own: the program reads the
page ids from the table as it goes. A sliding-window layer passes the table's columns of its window
and where the window starts (`start`): keys before it are masked, row by row.

A cache in FP8 storage (fp8.py: e4m3 values [.., H] and a power-of-two scale's exponent per vector) comes
in as it is stored, a byte a value: the TMA engine brings each block's values and their exponents
(the pool's exponents seen as rows of 128 bytes, `exponent_rows`), and the warpgroup writes the block
back to shared memory in the queries' dtype, each key's or value's vector times its scale (exact:
e4m3 has 3 significant bits, and a power of two only moves the exponent), before the tensor cores
read it. So the kernel's sums are those of the cache read back in 16 bits, and it reads half the bytes.

Only 8 of the 64 rows are real at gpt-oss's decode (one token, 8 query heads per KV head): the
tensor cores do 8x the useful work, which is still far below what reading the cache costs.

Legend: B = batch, T = queries, S = cache slots, K = KV heads, G = query heads per KV head, H = head
dim, R = 64 query rows per program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import paged
from ... import fp8
from ..blockwise import MASKED
from ..combine import fold_splits, lse_of
from ..mosaic import interpret_params, load, load_rows_strided, supported, tiles

ROWS = 64  # query rows of one program: one wgmma's M
LOG2E = math.log2(math.e)
EXPONENT_ROW = 128  # FP8 exponents a TMA row (bytes): at most 256, and shared memory at multiples of 128
__all__ = ["cache_attention", "default_block", "exponent_rows", "fits", "supported", "takes_pages"]


def fits(q_shape, slots: int, dtype) -> bool:
    """Whether `cache_attention` takes queries of this shape [B, T, K, G, H] and dtype over a cache of
    this many slots (the TMA engine copies tiles of 8 rows)."""
    _, T, _, G, H = q_shape
    return (T * G <= ROWS and H % 64 == 0 and H <= 256 and slots % 8 == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def takes_pages(page_size: int, pool=None) -> bool:
    """Whether the paged cache's pages of this many positions fit the kernel's key blocks (multiples
    of 64): a page a multiple of 64, or a multiple of 8 that divides 64; in FP8 storage, a page's
    exponents (of `pool` [N, P, K, H]) also whole rows of `EXPONENT_ROW` bytes."""
    fits_blocks = page_size % 64 == 0 or (page_size % 8 == 0 and 64 % page_size == 0)
    return fits_blocks and (not isinstance(pool, fp8.Fp8) or page_size * pool.shape[2] % EXPONENT_ROW == 0)


def exponent_rows(exponents):
    """An FP8 cache's exponents uint8 [.., S, K] (one per vector) as the TMA engine reads them: rows
    of `EXPONENT_ROW` bytes, [.., S K / 128, 128] (S K a multiple of 128)."""
    *lead, S, K = exponents.shape
    return exponents.reshape(*lead, S * K // EXPONENT_ROW, EXPONENT_ROW)


def default_block(programs: int) -> int:
    """Keys per block for this many (sequence, KV head) pairs: the fastest of 64, 128 and 256 on one
    NVIDIA H100 80GB at gpt-oss-20b's shapes (bench/kernels.py --part decode-attention): long blocks
    for one sequence (8 pairs), short ones for 64 (512 pairs), 128 between."""
    return 256 if programs <= 8 else 64 if programs >= 512 else 128


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "interpret"))
def cache_attention(q, k, v, kv_len, *, table=None, start=None, block_k: int | None = None,
                    splits: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, S, K, H] (16-bit, or FP8 storage, fp8.Fp8), every query seeing
    keys [0, kv_len[b]) -> (o [B, T, K, G, H] float32, lse [B, T, K, G] float32, -inf for a row that
    saw no key), sink-free.
    With `table` [B, W]: k and v are pools of pages [N, P, K, H], sequence b's key j in page
    table[b, j // P] (P a multiple of 8 that divides block_k, or block_k's multiple; in FP8, P K a
    multiple of 128).
    With `start` [B] (a sliding window): query t of sequence b sees keys [start[b] + t, kv_len[b]) only,
    and every query must see at least one key of a sequence that has any.

    `block_k`: keys per block (a multiple of 64; by default `default_block`, at least a page); `splits`:
    key ranges per (sequence, KV head), by default enough programs for about four per SM of a large GPU."""
    B, T, K, G, H = q.shape
    quantized = isinstance(k, fp8.Fp8)
    k_values, v_values = (k.values, v.values) if quantized else (k, v)
    P = k.shape[1]  # a page's positions (paged), or the cache's slots
    S = P if table is None else table.shape[1] * P
    block_k = block_k or default_block(B * K)
    if table is not None:
        block_k = max(block_k, P)
        if block_k % P or P % 8:
            raise ValueError(f"pages of {P} positions must be a multiple of 8 that divides the key block ({block_k})")
    if quantized:
        while block_k * K % EXPONENT_ROW:  # a block's exponents: whole rows (one KV head a device: 128 keys)
            block_k *= 2
        if (S if table is None else P) * K % EXPONENT_ROW:
            raise ValueError(f"an FP8 cache's exponents are read in rows of {EXPONENT_ROW} bytes: "
                             f"{'a page' if table is not None else 'the cache'} of {P} positions x {K} KV heads is not")
    if not supported():
        raise RuntimeError(f"the Mosaic GPU cache attention needs JAX >= 0.11, this is {jax.__version__}")
    if block_k % 64:
        raise ValueError(f"block_k={block_k} must be a multiple of 64")
    stored = jnp.dtype(fp8.DTYPE) if quantized else q.dtype
    if not fits(q.shape, S, q.dtype) or k_values.dtype != stored or v_values.dtype != stored:
        raise ValueError(f"the Mosaic GPU cache attention takes at most {ROWS} query rows (T * G = {T * G}), a head "
                         f"dim that is a multiple of 64 up to 256 (H = {H}), a multiple of 8 cache slots (S = {S}) "
                         f"and 16-bit q with k and v of its dtype or in FP8 storage (got {q.dtype}, "
                         f"{k_values.dtype}, {v_values.dtype})")
    bk = block_k
    if splits is None:
        splits = max(1, min(-(-S // bk), -(-528 // (B * K))))
    c = LOG2E / math.sqrt(H)  # scores in base 2: exp2(c * q.k) = exp(q.k / sqrt(H))
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)  # [B, K, T*G, H], row = t * G + g
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, ROWS - T * G), (0, 0)))
    tiles16 = tiles(q.dtype)

    per_block = bk // P if table is not None else 1  # pages a block of keys spans (paged)
    e_rows = bk * K // EXPONENT_ROW  # FP8: a block's exponents, rows of EXPONENT_ROW bytes (all KV heads)

    def body(len_ref, start_ref, table_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, o_ref, m_ref, l_ref, q_smem,
             k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, k_bar, v_bar, **fp8_smem):
        b, kh, part = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("s")
        n = len_ref[b]
        blocks = (n + bk - 1) // bk  # filled key blocks of this sequence
        per = (blocks + splits - 1) // splits
        first = part * per
        count = jnp.maximum(jnp.minimum(first + per, blocks) - first, 0)  # this program's blocks

        def page_ids(i):  # the pages of block first + i (paged; read a block ahead, so that the
            # load's latency passes while the block before is scored)
            if table is None:
                return ()
            return tuple(table_ref[b, jnp.minimum((first + i) * per_block + j, table_ref.shape[1] - 1)]
                         for j in range(per_block))

        def fetch(i, slot, pages):  # block first + i of this KV head into a buffer slot (in FP8, with
            # the block's exponents of every KV head, on the same barrier)
            if table is None:
                keys = (b, pl.ds((first + i) * bk, bk), kh)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])
                if quantized:
                    scales = (b, pl.ds((first + i) * e_rows, e_rows))
                    plgpu.copy_gmem_to_smem(ke_ref.at[scales], fp8_smem["ke_smem"].at[slot], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(ve_ref.at[scales], fp8_smem["ve_smem"].at[slot], v_bar.at[slot])
                return
            for j, page in enumerate(pages):  # its pages, each a copy with a barrier of its own
                rows = (slot, pl.ds(j * P, P))
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, kh], k_smem.at[rows], k_bar.at[slot * per_block + j])
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, kh], v_smem.at[rows], v_bar.at[slot * per_block + j])
                if quantized:
                    page_rows = e_rows // per_block
                    scales = (slot, pl.ds(j * page_rows, page_rows))
                    plgpu.copy_gmem_to_smem(ke_ref.at[page], fp8_smem["ke_smem"].at[scales], k_bar.at[slot * per_block + j])
                    plgpu.copy_gmem_to_smem(ve_ref.at[page], fp8_smem["ve_smem"].at[scales], v_bar.at[slot * per_block + j])

        def wait(bars, slot):
            for j in range(per_block):
                plgpu.barrier_wait(bars.at[slot * per_block + j])

        def readable(stored, exponents, slot, out):
            """Block `slot` of keys or values as the tensor cores read them: 16-bit as stored, or FP8
            written to `out` in q's dtype, each vector times its scale."""
            if not quantized:
                return stored.at[slot]
            if interpret:  # (the interpreter reshapes values, not refs)
                e = exponents[slot].reshape(bk, K)[:, kh]
            else:  # column kh of the block's exponents [bk, K], row-major
                flat = exponents.reshape(2 * bk * K)
                e = load_rows_strided(flat.at[pl.ds(slot * bk * K + kh, (bk - 1) * K + 1)], bk, K)
            x = load(stored, slot, plgpu.Layout.WGMMA, interpret).astype(jnp.float32)  # [bk, H]
            out[...] = (x * fp8.scale(e)[:, None]).astype(out.dtype)
            plgpu.commit_smem()
            return out

        plgpu.copy_gmem_to_smem(q_ref.at[b, kh], q_smem, q_bar)

        @pl.when(count > 0)
        def _():
            fetch(0, 0, page_ids(0))

        plgpu.barrier_wait(q_bar)
        m = plgpu.layout_cast(jnp.full((ROWS,), MASKED, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((ROWS, H), jnp.float32), plgpu.Layout.WGMMA)

        def visit(i, carry):
            m, l, acc, pages = carry
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < count)
            def _():  # the next block streams in while this one is scored (its slot was read last step)
                fetch(i + 1, 1 - slot, pages)

            pages = page_ids(i + 2)

            wait(k_bar, slot)
            keys = readable(k_smem, fp8_smem.get("ke_smem"), slot, fp8_smem.get("k16_smem"))

            def scores(ref):
                plgpu.wgmma(ref, q_smem, keys.transpose((1, 0)))
                return ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))  # [R, bk]
            key = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
            seen = key < n - (first + i) * bk
            if start is not None:  # row t * G + g sees keys from start + t: row < (key - start + 1) G
                row = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 0, layout=plgpu.Layout.WGMMA)
                seen &= row < (key + ((first + i) * bk - start_ref[b] + 1)) * G
            s = jnp.where(seen, s * c, MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            wait(v_bar, slot)
            values = readable(v_smem, fp8_smem.get("ve_smem"), slot, fp8_smem.get("v16_smem"))

            p_smem[...] = p.astype(p_smem.dtype)  # the tensor cores read both operands from shared memory
            plgpu.commit_smem()

            def products(ref):
                plgpu.wgmma(ref, p_smem, values)
                return ref[...]

            pv = pl.run_scoped(products, plgpu.ACC((ROWS, H), jnp.float32))  # [R, H]
            return m_new, l, acc + pv, pages

        m, l, acc, _ = lax.fori_loop(0, count, visit, (m, l, acc, page_ids(1)))
        l = jnp.where(m > MASKED / 2, l, 0.0)  # a row that saw only masked keys saw none: lse -inf
        o_smem[...] = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, part, kh])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, part, kh])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, part, kh])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    # FP8: the values as stored (no transforms: the warpgroup reads them, not the tensor cores), their
    # exponents, and one block of each in q's dtype for the tensor cores; a barrier sees both copies
    staged = dict(transforms=()) if quantized else dict(transforms=tiles16)
    fp8_scratch = dict(ke_smem=plgpu.SMEM((2, e_rows, EXPONENT_ROW), jnp.uint8),
                       ve_smem=plgpu.SMEM((2, e_rows, EXPONENT_ROW), jnp.uint8),
                       k16_smem=plgpu.SMEM((bk, H), q.dtype, transforms=tiles16),
                       v16_smem=plgpu.SMEM((bk, H), q.dtype, transforms=tiles16)) if quantized else {}
    arrivals = 2 if quantized else 1
    kernel = plgpu.kernel(
        body, grid=(B, K, splits), grid_names=("b", "k", "s"), interpret=interpret_params(interpret),
        out_type=(jax.ShapeDtypeStruct((B, splits, K, ROWS, H), f32), jax.ShapeDtypeStruct((B, splits, K, ROWS), f32),
                  jax.ShapeDtypeStruct((B, splits, K, ROWS), f32)),
        scratch_types=dict(q_smem=plgpu.SMEM((ROWS, H), q.dtype, transforms=tiles16),
                           k_smem=plgpu.SMEM((2, bk, H), k_values.dtype, **staged),
                           v_smem=plgpu.SMEM((2, bk, H), v_values.dtype, **staged),
                           p_smem=plgpu.SMEM((ROWS, bk), q.dtype, transforms=tiles16),
                           o_smem=plgpu.SMEM((ROWS, H), f32, transforms=tiles(f32)),
                           m_smem=plgpu.SMEM((ROWS,), f32), l_smem=plgpu.SMEM((ROWS,), f32),
                           q_bar=plgpu.Barrier(),
                           k_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2 * per_block),
                           v_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2 * per_block), **fp8_scratch))
    pages = jnp.zeros((1, 1), jnp.int32) if table is None else table.astype(jnp.int32)
    starts = jnp.zeros((1,), jnp.int32) if start is None else start.astype(jnp.int32)
    if quantized:
        k_exp, v_exp = exponent_rows(k.exponents), exponent_rows(v.exponents)
    else:  # (unread)
        k_exp = v_exp = jnp.zeros((1, 1, EXPONENT_ROW), jnp.uint8)
    o, m, l = kernel(kv_len.astype(jnp.int32), starts, pages, rows, k_values, v_values, k_exp, v_exp)
    lse = lse_of(m / LOG2E, l)  # the row max in the natural base
    return fold_splits(o[:, :, :, : T * G], lse[..., : T * G], T, G)


# The attention variant "mosaic" (kernels/attention/__init__.py): decode-sized calls on Hopper; None where
# the kernel does not take the call (the jnp path runs it).
def mosaic_prefix(q, k, v, lengths, *, kernels):
    S, K = k.shape[1:3]
    if not fits(q.shape, S, q.dtype) or (isinstance(k, fp8.Fp8) and S * K % EXPONENT_ROW):
        return None
    return cache_attention(q, k, v, lengths, interpret=kernels.interpret)


def mosaic_paged_full(q, pool_k, pool_v, table, lengths, *, kernels, mesh):
    P = pool_k.shape[1]
    if mesh is not None or not takes_pages(P, pool_k) or not fits(q.shape, table.shape[1] * P, q.dtype):
        return None
    return cache_attention(q, pool_k, pool_v, lengths, table=table, interpret=kernels.interpret)


def mosaic_paged_window(q, pool_k, pool_v, table, lengths, positions, *, window, pages, kernels, mesh):
    """A sliding layer's decode over the pages of its window (as `paged.window`): the table's columns
    from the page holding the window's first position, positions counted from that page."""
    P = pool_k.shape[1]
    if mesh is not None or not takes_pages(P, pool_k) or not fits(q.shape, pages * P, q.dtype):
        return None
    first, ids = paged.window_table(table, lengths, window=window, pages=pages, page_size=P)
    return cache_attention(q, pool_k, pool_v, lengths - first * P, table=ids, start=lengths - window + 1 - first * P,
                           block_k=max(64, P), interpret=kernels.interpret)
