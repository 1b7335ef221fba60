import gc
import os
import signal
import sys
import tempfile
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# 8 CPU devices for the sharded tests (tests/test_sharding.py); everything else runs on the first.
# A config option rather than XLA_FLAGS, so that the commands the tests start see one device.
jax.config.update("jax_num_cpu_devices", 8)
# The command line keeps compiled steps in the user's cache folder; the tests' go to a folder of their
# own (the commands they start inherit it), never into the home of whoever runs them.
os.environ["XDG_CACHE_HOME"] = os.path.join(tempfile.mkdtemp(prefix="gptoss-tests-"), "cache")

sys.path.insert(0, os.path.dirname(__file__))  # for refs.py

import gptoss_jax as gj  # noqa: E402
from gptoss_jax.testing import random_params  # noqa: E402


VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tokenizer", "o200k_base.tiktoken")
needs_vocab = pytest.mark.skipif(not os.path.isfile(VOCAB), reason=(
    f"the genuine o200k_base vocabulary is not at {os.path.normpath(VOCAB)}: download o200k_base.tiktoken "
    f"(docs/generating.md, 'Getting started with the real models', says from where) and put it there"))


def rel_err(actual, reference) -> float:
    """max |actual - reference| / max |reference|: how far apart two results are (for checks that they differ)."""
    actual = np.asarray(actual, np.float64)
    reference = np.asarray(reference, np.float64)
    chex.assert_equal_shape([actual, reference])
    chex.assert_tree_all_finite(actual)
    return float(np.abs(actual - reference).max() / np.abs(reference).max())


def packed_with_extreme_scales(rng, E, F, D):
    """Random MXFP4-packed experts [E, F, D] (blocks, scales) whose rows 0-7 have tiny scales
    (2^-117), rows 8-15 large ones (2^73), rows 16-23 both, alternating by block, the rest typical
    ones: the row groups of EXTREME_ROWS."""
    import jax.numpy as jnp

    blocks = rng.integers(0, 256, (E, F, D // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 128, (E, F, D // 32), dtype=np.uint8)
    scales[:, :8] = 10  # 2^-117
    scales[:, 8:16] = 200  # 2^73
    scales[:, 16:24, ::2] = 200  # mixed within a row
    return jnp.asarray(blocks), jnp.asarray(scales)


EXTREME_ROWS = (slice(0, 8), slice(8, 16), slice(16, 24), slice(24, None))


def expected_spec(axes, shape, mesh, rules):
    """A rules table (sharding.RULES or STATE_RULES) read directly: each logical axis on its mesh axis
    if that is > 1 and divides (the axes that may fall back replicate otherwise; anything else would
    have been refused)."""
    from jax.sharding import PartitionSpec

    out = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = rules[name]
        n = mesh.shape[mesh_axis] if mesh_axis else 1
        out.append(mesh_axis if n > 1 and size % n == 0 else None)
    return PartitionSpec(*out)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for the coordinator of several local processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True, scope="module")
def _compiled_code_freed_after_each_file():
    """Drops JAX's compiled functions after each test file. Every XLA CPU executable holds about three
    memory mappings, and one process running the whole suite compiles thousands: past Linux's default
    limit (vm.max_map_count, 65530 mappings a process) the compiler's next allocation fails and the
    process dies with a segmentation fault."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny():
    return gj.ModelConfig.tiny()


@pytest.fixture(scope="session")
def tiny_params(tiny):
    return random_params(tiny, seed=0)


@pytest.fixture(scope="session")
def tiny_f32(tiny):
    """(the tiny config, its float32 parameters): the serving engine's tests, where greedy tokens must
    equal `Generator`'s exactly."""
    return tiny, random_params(tiny, seed=3, dtype=jnp.float32)


@pytest.fixture(scope="session")
def long_tokens(tiny):
    # 300 tokens: 18x the tiny window (16) and past its YaRN initial context (256).
    return np.random.default_rng(1).integers(0, tiny.vocab_size, size=(1, 300)).astype(np.int32)


def wait_for_signal_handlers(process, timeout: float = 30) -> None:
    """Until the command has installed its SIGINT/SIGTERM handlers (Python alone catches no SIGTERM):
    before that, only Python's own start-up runs, which no program can guard."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open(f"/proc/{process.pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.01)
    raise AssertionError("the command never installed its signal handlers")
