"""gptoss-jax checkpoints: an Orbax checkpoint per item, written one item at a time.

    CHECKPOINT/
      gptoss_checkpoint.json   format version, converter version, source layout, expert storage, items
      config.json              the ModelConfig
      params/embedding/        Orbax checkpoints of {"embedding"}, {"block_N": ...} for each layer,
      params/block_N/          and {"norm", "unembedding"}: the converter streams item by item, so
      params/final/            memory stays near one layer's size
Expert weights are stored either decoded ([E, out, in], like the parameters) or, by default, packed
as published: `mlp1_weight` becomes {"blocks": uint8 [E, out, in/32, 16], "scales": uint8 [E, out, in/32]}
(the on-disk form of an `mxfp4.MXFP4`, converted at this boundary) and is decoded when loaded, or
kept packed (dtype "mxfp4"). Attention's q, k and v, one fused weight in the model, are stored as
three (`q_weight` [D, N, H], `k_weight` and `v_weight` [D, K, H], and their biases), as published
and as checkpoints written before the model fused them, which load unchanged. Expert arrays are
stored one expert per chunk, so that loading onto a mesh reads, in each process, only the experts
its devices hold. Other arrays above `CHUNK_BYTES`
(the embedding and unembedding: 1.2 GB each in gpt-oss) are stored in chunks of at most that size and
loaded a chunk at a time, so that host memory stays near one layer's size while loading too.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import ModelConfig
from .metadata import META_FILE, expand, item_names, read_metadata, write_metadata
from .model.moe import EXPERT_WEIGHTS
from .mxfp4 import DTYPE, MXFP4, packed, split_dtype, unpack_experts
from .params import abstract_params, param_shardings
from .stored import fuse_attention, from_groups, stored_form
from .weight import Params, at_path

EXPERT_STORAGES = ("mxfp4", "bfloat16", "float32")
# Largest stored chunk of a non-expert array, and the most the loader reads at once without a mesh
# (two reads in flight; a gpt-oss-20b layer with packed experts is about 470 MB).
CHUNK_BYTES = 64 << 20
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _item(params: Params, name: str) -> Params:
    if name == "final":
        return {"norm": params["norm"], "unembedding": params["unembedding"]}
    return {name: params[name]}


def storage_spec(config: ModelConfig, storage: str) -> Params:
    """`jax.ShapeDtypeStruct`s of everything a checkpoint with this expert storage holds."""
    if storage not in EXPERT_STORAGES:
        raise ValueError(f"unknown expert storage {storage!r}; expected one of {', '.join(EXPERT_STORAGES)}")
    return abstract_params(config, storage)  # the storages are the parameters' dtypes, "mxfp4" included


def item_spec(config: ModelConfig, storage: str, name: str) -> Params:
    return _item(storage_spec(config, storage), name)


def save_item(directory: str, name: str, tree: Params, *, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write one item (numpy arrays; packed experts as MXFP4) as its own Orbax checkpoint, synchronously.

    Expert weights (and their packed blocks and scales) are stored one expert per chunk, so that a
    process holding some of the experts reads only theirs (see `load_checkpoint(mesh=...)`). Other
    arrays above chunk_bytes are stored in chunks of at most chunk_bytes, which the loader reads one
    at a time.
    """
    import orbax.checkpoint as ocp

    def save_args(path, x):
        if {str(getattr(p, "key", "")) for p in path} & set(EXPERT_WEIGHTS):
            return ocp.SaveArgs(shard_axes=(0,) if x.shape[0] > 1 else ())  # chunks of one expert
        return ocp.SaveArgs(chunk_byte_size=chunk_bytes if x.nbytes > chunk_bytes else None)

    tree = stored_form(tree)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, "params", name)), tree,
                      save_args=jax.tree_util.tree_map_with_path(save_args, tree))
    checkpointer.wait_until_finished()
    checkpointer.close()


def save_checkpoint(directory: str | os.PathLike, config: ModelConfig, params: Params, **fields) -> None:
    """Write params as a checkpoint `load_checkpoint` reads, into `directory`, which may
    hold other files (a fine-tuning run's train states). Packed (MXFP4) experts are stored packed,
    and the rest must then be bfloat16, as dtype "mxfp4" makes them. The items are written into a hidden folder
    beside, moved into place, and the metadata file, which makes the folder a checkpoint, comes
    last: a failure leaves no checkpoint, or the previous one, never a partial one.

    Params split over the devices of several processes (fine-tuning on several hosts) are gathered
    an item at a time; every process must call this, process 0 moves the files into place, and the
    folder must be one that every process can write (shared storage).
    """
    import shutil
    import tempfile

    from jax.experimental import multihost_utils

    directory = os.path.abspath(expand(directory))
    experts = params["block_0"]["mlp"]["mlp1_weight"]
    storage = DTYPE if packed(experts) else dtype_name(experts.dtype)
    if packed(experts) and (found := params["embedding"].dtype) != jnp.bfloat16:
        raise ValueError(f"packed (MXFP4) experts are stored beside bfloat16 weights (dtype \"mxfp4\"), but "
                         f"embedding is {found}: cast the other weights to bfloat16, or decode the experts "
                         f"(mxfp4.decode_params), before saving")
    several, primary = jax.process_count() > 1, jax.process_index() == 0
    if several:  # one work folder for all, made by process 0 (Orbax writes into it from each process)
        work = os.path.join(directory, ".params-partial")
        if primary:
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
        multihost_utils.sync_global_devices("gptoss_jax save_checkpoint: work folder")
    else:
        os.makedirs(directory, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".params-partial-", dir=directory)
    try:
        for name in item_names(config):
            save_item(work, name, jax.tree.map(_on_host, _item(params, name)))
        if not primary:
            return
        meta_path = os.path.join(directory, META_FILE)
        if os.path.exists(meta_path):
            os.remove(meta_path)  # from here until the new one is written, the folder is not a checkpoint
        old = os.path.join(work, "old")
        if os.path.exists(os.path.join(directory, "params")):
            os.rename(os.path.join(directory, "params"), old)
        os.rename(os.path.join(work, "params"), os.path.join(directory, "params"))
        write_metadata(work, config, expert_storage=storage, **fields)
        os.replace(os.path.join(work, "config.json"), os.path.join(directory, "config.json"))
        os.replace(os.path.join(work, META_FILE), meta_path)
    finally:
        if primary:
            shutil.rmtree(work, ignore_errors=True)
        if several:
            multihost_utils.sync_global_devices("gptoss_jax save_checkpoint: done")


def _on_host(x) -> np.ndarray:
    """An array's whole value on this host (gathered from the other processes where it is split)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _param_dtype(path, dtype: str) -> np.dtype:
    """The dtype a stored float leaf loads as: RMSNorm scales stay float32, the rest takes dtype."""
    return np.dtype(np.float32) if str(path[-1].key) == "scale" else _NP_DTYPES[dtype]


def _to_param(path, stored, dtype: str, keep_packed: bool):
    """A stored leaf (or packed experts' MXFP4) as the parameter of the given dtype (packed experts
    stay packed with keep_packed)."""
    if packed(stored):
        if keep_packed:
            return MXFP4(jnp.asarray(stored.blocks), jnp.asarray(stored.scales))
        return jnp.asarray(unpack_experts(np.asarray(stored.blocks), np.asarray(stored.scales), dtype))
    return jnp.asarray(np.asarray(stored).astype(_param_dtype(path, dtype), copy=False))  # no copy when stored so


def dtype_name(dtype) -> str:
    """"bfloat16" or "float32", from a name or any dtype object (jnp.float32, np.dtype, ...)."""
    if isinstance(dtype, str) and dtype == "mxfp4":
        raise ValueError("mxfp4 is for the experts only: load_checkpoint(path, dtype=\"mxfp4\") keeps them packed "
                         "and loads the rest in bfloat16")
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _NP_DTYPES:
        raise ValueError(f"dtype must be bfloat16 or float32 (a name or a dtype), got {dtype!r}")
    return name


def _spec_bytes(tree) -> int:
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def load_checkpoint(path: str | os.PathLike, *, dtype=None, mesh=None,
                    progress: bool = False) -> tuple[ModelConfig, Params]:
    """Restore a converted checkpoint -> (config, params), item by item.

    dtype: bfloat16 or float32 (a name or a dtype such as jnp.float32) for the parameters, experts
    decoded; None keeps what was stored (bfloat16 for packed experts). "mxfp4": the experts stay
    packed as stored (`mxfp4.MXFP4`s of uint8 blocks and scales, decoded where the model uses them; the
    checkpoint must store them packed, the converter's default) and the rest is bfloat16. Norm
    scales are float32 either way.
    mesh: lay the parameters out on this mesh (sharding.make_mesh), as the rules in sharding.py
    say. Each item goes straight into its sharded layout: every process reads only the slices its
    own devices hold, and no device ever holds a whole parameter that the rules split.
    Without a mesh, everything goes to the default device.
    progress: show a bar over the items (bytes read, ETA) on stderr. `~` in `path` is expanded.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    config, meta = read_metadata(path)
    path = expand(path)
    storage = meta["expert_storage"]
    asked = dtype
    dtype, keep_packed = split_dtype(dtype)
    if keep_packed and storage != DTYPE:
        raise ValueError(f"{path}: this checkpoint stores its experts decoded ({storage}), so they cannot stay "
                         f"packed; convert the published checkpoint again with --dtype mxfp4 (the default for "
                         f"MXFP4 sources), or load this one with dtype bfloat16")
    dtype = dtype_name(dtype) if dtype is not None else ("float32" if storage == "float32" else "bfloat16")
    names = item_names(config)
    specs = {name: item_spec(config, storage, name) for name in names}
    shardings = None
    if mesh is not None:
        # Checks the mesh against the model before any read.
        shardings = param_shardings(config, mesh, dtype=asked if keep_packed else dtype)
    checkpointer = ocp.StandardCheckpointer()
    params: Params = {}
    # Before any read: a failed restore's other reads can land before its error reaches us.
    _quiet_late_reads()
    with tqdm(total=sum(_spec_bytes(s) for s in specs.values()), unit="B", unit_scale=True, desc="loading",
              disable=not progress, file=sys.stderr, leave=False) as bar:
        for i, name in enumerate(names):
            bar.set_postfix_str(f"item {i + 1}/{len(names)} ({name})", refresh=False)
            item_dir = os.path.abspath(os.path.join(path, "params", name))
            if not os.path.isdir(item_dir):
                raise ValueError(f"{item_dir}: missing checkpoint item {name!r}")
            layout = _stored_layout(checkpointer, item_dir, name)
            _check_layout(layout, specs[name], item_dir)
            layout = from_groups(specs[name], layout)
            if shardings is None and _chunked(layout, keep_packed):
                params.update(fuse_attention(_restore_by_chunks(item_dir, name, layout, dtype)))
            elif shardings is None:
                stored = _restore(checkpointer, item_dir, name)
                params.update(fuse_attention(jax.tree_util.tree_map_with_path(
                    lambda p, x: _to_param(p, x, dtype, keep_packed), from_groups(specs[name], stored),
                    is_leaf=packed)))
            else:
                params.update(_restore_sharded(checkpointer, item_dir, name, specs[name],
                                               _item(shardings, name), dtype, keep_packed))
            bar.update(_spec_bytes(specs[name]))
    return config, params


def _layout(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)


def _check_layout(stored, spec, item_dir: str) -> None:
    """ValueError unless a stored item (on-disk form: packed experts as groups) matches its spec."""
    got, want = _layout(stored), _layout(stored_form(spec))
    if got != want:
        raise ValueError(f"{item_dir}: contents do not match config.json (expected {want}, found {got})")


def _stored_layout(checkpointer, item_dir: str, name: str):
    """The stored arrays' shapes and dtypes, from the item's metadata (no array is read)."""
    try:
        meta = checkpointer.metadata(item_dir)
    except Exception as e:
        raise _unreadable(item_dir, name, e) from None
    meta = getattr(meta, "item_metadata", meta)
    return getattr(meta, "tree", meta)


def _chunk_shape(meta) -> tuple[int, ...] | None:
    """The chunks a stored array is split into (None: stored whole, or not an array)."""
    chunks = getattr(getattr(meta, "storage", None), "chunk_shape", None)
    if chunks is None or len(chunks) != len(meta.shape) or tuple(chunks) == tuple(meta.shape):
        return None
    return tuple(chunks)


def _chunked(layout, keep_packed: bool) -> bool:
    """Whether an item is read chunk by chunk: it holds arrays stored in chunks (the embedding and
    unembedding, expert arrays: one expert a chunk), and no packed experts that are to be decoded
    on the host (those items go through Orbax's restore, then the decoder)."""
    if not keep_packed and any(packed(x) for x in jax.tree.leaves(layout, is_leaf=packed)):
        return False
    return any(_chunk_shape(x) is not None for x in jax.tree.leaves(layout))


def _reads(shape: tuple[int, ...], chunks: tuple[int, ...] | None, itemsize: int):
    """The reads covering an array stored in `chunks`: whole chunks, as many together along the
    first axis the chunks split as fit in CHUNK_BYTES -> [(start, stop) per axis] per read."""
    if chunks is None:
        return [tuple((0, n) for n in shape)]
    axis = next(i for i, (c, n) in enumerate(zip(chunks, shape)) if c < n)
    block = list(chunks)
    block[axis] *= max(1, CHUNK_BYTES // (math.prod(chunks) * itemsize))
    return [tuple((a, min(a + c, n)) for a, c, n in zip(start, block, shape))
            for start in itertools.product(*(range(0, n, c) for n, c in zip(shape, block)))]


@functools.partial(jax.jit, donate_argnums=0)
def _place(whole: jax.Array, part: jax.Array, start: jax.Array) -> jax.Array:
    """whole with part written at start, in place. As unsigned integers of the same width: XLA's CPU
    backend would otherwise widen a bfloat16 array to float32 and back, a pass over all of it."""
    bits = jnp.dtype(f"uint{8 * whole.dtype.itemsize}")
    as_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=bits)
    out = jax.lax.dynamic_update_slice(as_bits(whole), as_bits(part), tuple(start))
    return jax.lax.bitcast_convert_type(out, whole.dtype)


def _restore_by_chunks(item_dir: str, name: str, layout, dtype: str) -> Params:
    """An item read array by array, in reads of whole stored chunks of at most CHUNK_BYTES (or one
    chunk), each placed on the default device on its own, into the array (donated, so the device
    holds it once). The host holds at most two reads: the one being placed and the next, read
    meanwhile. Packed experts stay packed (their uint8 blocks and scales as stored)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    # Few threads of its own (TensorStore's defaults run about one per core): each thread that
    # allocates may get an allocator arena of its own, which keeps what is freed (hostmem.py).
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                          "data_copy_concurrency": {"limit": 2}, "file_io_concurrency": {"limit": 4}})
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(item_dir)

    def read(path, meta):
        if not jnp.issubdtype(meta.dtype, jnp.floating):
            want = np.dtype(meta.dtype)  # packed blocks and scales
        else:
            want = _param_dtype(path, dtype)
        info = ocp.type_handlers.ParamInfo(name=meta.name, parent_dir=epath.Path(item_dir), ts_context=context,
                                           path=epath.Path(item_dir) / meta.name, is_ocdbt_checkpoint=ocdbt)
        try:
            stored = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt), context=context).result()
            reads = _reads(tuple(meta.shape), _chunk_shape(meta), np.dtype(meta.dtype).itemsize)
            if len(reads) == 1:
                return jnp.asarray(np.asarray(stored.read().result()).astype(want, copy=False))
            whole = jnp.zeros(meta.shape, want)
            pending = stored[tuple(slice(a, b) for a, b in reads[0])].read()
            for i, box in enumerate(reads):
                current = pending
                if i + 1 < len(reads):  # the next read runs while this one is placed
                    pending = stored[tuple(slice(a, b) for a, b in reads[i + 1])].read()
                part = np.asarray(current.result()).astype(want, copy=False)
                # Waiting here keeps the host from queueing reads faster than the device takes them.
                whole = jax.block_until_ready(_place(whole, part, np.asarray([a for a, _ in box], np.int32)))
            return whole
        except Exception as e:  # TensorStore errors: one line naming the item
            raise _unreadable(item_dir, name, e) from None

    return jax.tree_util.tree_map_with_path(read, layout)


def _packed_sharding(param_sharding, groups: int, scales: bool):
    """Blocks [E, out, G, 16] / scales [E, out, G] of an expert weight [E, out, in]: split as the
    weight on E and out; on G only where the weight's `in` split falls on whole 32-value blocks."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = param_sharding.mesh
    e, out, inp = tuple(param_sharding.spec) + (None,) * (3 - len(param_sharding.spec))
    if inp is not None and groups % mesh.shape[inp]:
        inp = None
    return NamedSharding(mesh, PartitionSpec(e, out, inp) if scales else PartitionSpec(e, out, inp, None))


def _restore_sharded(checkpointer, item_dir: str, name: str, spec: Params, shardings: Params, dtype: str,
                     keep_packed: bool):
    """One item restored into its sharded layout: Orbax reads each device's slice; packed experts
    stay packed (keep_packed: shardings holds their blocks' and scales' layouts) or are decoded
    shard by shard on the host (the exact table decoder) and placed on their devices."""
    def target(path, leaf):
        param_sharding = at_path(shardings, path)
        if packed(leaf) and keep_packed:
            return MXFP4(*(jax.ShapeDtypeStruct(part.shape, jnp.uint8, sharding=s)
                           for part, s in zip(leaf, param_sharding, strict=True)))
        if packed(leaf):
            groups = leaf.scales.shape[-1]
            return MXFP4(jax.ShapeDtypeStruct(leaf.blocks.shape, jnp.uint8,
                                              sharding=_packed_sharding(param_sharding, groups, False)),
                         jax.ShapeDtypeStruct(leaf.scales.shape, jnp.uint8,
                                              sharding=_packed_sharding(param_sharding, groups, True)))
        return jax.ShapeDtypeStruct(leaf.shape, _param_dtype(path, dtype), sharding=param_sharding)

    targets = jax.tree_util.tree_map_with_path(target, spec, is_leaf=packed)
    stored = from_groups(spec, _restore(checkpointer, item_dir, name, stored_form(targets)))
    if not keep_packed:
        stored = jax.tree_util.tree_map_with_path(
            lambda p, x: _unpack_sharded(x, at_path(shardings, p), dtype) if packed(x) else x, stored, is_leaf=packed)
    return fuse_attention(stored, shardings)


def _unpack_sharded(weight: MXFP4, param_sharding, dtype: str) -> jax.Array:
    """Decode sharded packed experts into the weight [E, out, in] with the given sharding.

    Each device's blocks cover its experts and output rows (and its input columns, or all of them);
    a device's slice is decoded from its own blocks, once per distinct slice.
    """
    E, out, groups = weight.scales.shape
    shape = (E, out, groups * 32)
    blocks = {s.device: s for s in weight.blocks.addressable_shards}
    scales = {s.device: s for s in weight.scales.addressable_shards}
    decoded: dict = {}
    arrays = []
    for device, index in param_sharding.addressable_devices_indices_map(shape).items():
        key = tuple((i.start, i.stop) for i in index)
        if key not in decoded:
            b, s = blocks[device], scales[device]
            values = unpack_experts(np.asarray(b.data), np.asarray(s.data), dtype)  # [E_l, out_l, cols]
            first_col = b.index[2].start or 0
            cols = index[2]
            decoded[key] = values[:, :, (cols.start or 0) - first_col * 32:
                                  (cols.stop if cols.stop is not None else shape[2]) - first_col * 32]
        arrays.append(jax.device_put(decoded[key], device))
    return jax.make_array_from_single_device_arrays(shape, param_sharding, arrays)


def _restore(checkpointer, item_dir: str, name: str, targets=None):
    try:
        return checkpointer.restore(item_dir, targets)
    except Exception as e:  # Orbax/TensorStore errors: one line naming the item
        raise _unreadable(item_dir, name, e) from None


def _unreadable(item_dir: str, name: str, e: Exception) -> ValueError:
    """The one-line error for an item that cannot be read (what its other reads still print is
    dropped by the filters load_checkpoint installs before the first read)."""
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(f"{item_dir}: cannot read checkpoint item {name!r}; is the checkpoint truncated or "
                      f"damaged? ({detail})")


def _late_read(e) -> bool:
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


_STATUS_ERROR = re.compile(r"^[A-Z][A-Z_]+: ")  # TensorStore's errors: an absl status code, "OUT_OF_RANGE: ..."


class _LateReadLog(logging.Filter):
    """Drops asyncio's "Future exception was never retrieved" records for TensorStore read errors:
    the other reads of a restore that already failed (and was reported) fail too, after Orbax stopped
    awaiting them, and asyncio logs each when the garbage collector frees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        never_retrieved = "exception was never retrieved" in record.getMessage()
        return not (never_retrieved and error is not None and _STATUS_ERROR.match(str(error)))


def _quiet_late_reads() -> None:
    """After a failed restore, the reads still in flight would print at some later moment, even
    before the restore's error reaches the caller; drop exactly those (installed once, before the
    first read), so that the error the caller reports is the only line:
    - reads that finish into Orbax's closed event loop ("Event loop is closed"), which reach Python
      as unraisable exceptions or, from TensorStore's own threads, through sys.excepthook (seen in a
      test run on a loaded 2-core machine);
    - reads that failed in their turn, which asyncio logs as "Future exception was never retrieved"
      when their futures are freed (seen on a clean install with Python 3.11, jax 0.10.2).
    Reads that land while the interpreter shuts down, when these hooks are gone, still print: the
    command lines therefore leave a failed run without the interpreter's clean-up (cli/command.py)."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _LateReadLog) for f in asyncio_log.filters):
        asyncio_log.addFilter(_LateReadLog())
    if not getattr(sys.unraisablehook, "_gptoss_quiet", False):
        previous_unraisable = sys.unraisablehook

        def unraisable_hook(unraisable):
            if not _late_read(unraisable.exc_value):
                previous_unraisable(unraisable)

        unraisable_hook._gptoss_quiet = True
        sys.unraisablehook = unraisable_hook
    if not getattr(sys.excepthook, "_gptoss_quiet", False):
        previous_except = sys.excepthook

        def except_hook(kind, value, traceback):
            if not _late_read(value):
                previous_except(kind, value, traceback)

        except_hook._gptoss_quiet = True
        sys.excepthook = except_hook
