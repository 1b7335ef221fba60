import contextlib
import gc
import os
import shutil
import signal
import sys
import time

# Bytecode. Where PYTHONDONTWRITEBYTECODE is set (some sandboxes and CI images set it), every Python
# process compiles each module it imports from source: jax, torch, transformers and the package
# again in each pytest worker and in each of the hundreds of commands the tests start, about 5 s a
# process (tests/test_commands.py: 117 s with it, 32 s without). The tests write bytecode instead,
# into a folder of their own beside pytest's cache (PYTHONPYCACHEPREFIX, so nothing lands in the
# source trees), kept between runs: the first process to import a module compiles it, the others
# read it. Python checks a cached module against its source's time and size before using it.
# Before the imports below, so that they are cached too; pytest-xdist's workers and the commands
# inherit the environment.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(ROOT, ".pytest_cache", "pycache"))
    sys.dont_write_bytecode = False
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]


def _older_cpu_emitters() -> str:
    """XLA's flag for its CPU backend's older loop emitters where this jaxlib has it (jax 0.10 does,
    0.11 no longer), else "". XLA ends the process on a flag it does not know, so the first process
    of a run asks a child with the flag set, and keeps the answer for this jaxlib in pytest's cache."""
    from importlib.metadata import version
    import subprocess

    flag = "--xla_cpu_use_fusion_emitters=false"
    known = os.path.join(ROOT, ".pytest_cache", f"older-cpu-emitters-jaxlib-{version('jaxlib')}")
    if not os.path.exists(known):
        child = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                               text=True, env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"})
        if child.returncode != 0 and "Unknown flag" not in child.stderr:
            return ""  # the child failed for another reason: no answer kept, none used this run
        os.makedirs(os.path.dirname(known), exist_ok=True)
        with open(known, "w") as f:
            f.write("yes" if child.returncode == 0 else "no")
    with open(known) as f:
        return flag if f.read() == "yes" else ""


# The loops XLA's CPU backend fuses are compiled by its older emitters where this jaxlib still has
# them: about a third less compile time for the tiny models' steps than through MLIR's (a run of the
# command line's and the serving engine's steps and a training step: 10.4 s against 15.7 s), and
# compiling is most of the suite's time. Both emit the same operations without fast-math, so the
# programs compute the same up to float noise. Set before JAX starts its CPU backend, so that the
# workers and the commands the tests start (command_env) inherit it.
# A choice given in XLA_FLAGS stands (and reaches the commands too).
EMITTERS = os.environ.get("GPTOSS_TEST_EMITTERS_FLAG")
if EMITTERS is None:  # the run's first process
    _given = [f for f in os.environ.get("XLA_FLAGS", "").split() if "fusion_emitters" in f]
    EMITTERS = _given[-1] if _given else _older_cpu_emitters()
    os.environ["GPTOSS_TEST_EMITTERS_FLAG"] = EMITTERS
    if EMITTERS and not _given:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EMITTERS}".strip()

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# 8 CPU devices for the sharded tests (tests/test_sharding.py); everything else runs on the first.
# A config option rather than XLA_FLAGS, so that the commands the tests start see one device.
CPU_DEVICES = 8
jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
# XLA runs every CPU device's program, and each program's independent operations, on one pool of
# threads, as many as there are devices by default, and a device waiting in a collective (an
# all-reduce of the sharded tests) holds its thread until its peers arrive. With only 8 threads for
# 8 devices, a device whose turn is queued behind waiting threads never arrives: the process aborts
# after XLA's 40 s rendezvous timeout (more likely on a busy machine). XLA sizes the pool from NPROC;
# twice the devices leaves room (tests/test_suite.py holds it). Set before the CPU backend starts.
NPROC_FOR_THE_TESTS = 2 * CPU_DEVICES
if not os.environ.get("NPROC", "").isdigit() or int(os.environ["NPROC"]) < NPROC_FOR_THE_TESTS:
    os.environ["NPROC"] = str(NPROC_FOR_THE_TESTS)
# The tests' programs are compiled by XLA's CPU backend without LLVM's optimisations: most of the
# suite's time is compiling the tiny models' steps, which this cuts by about a third, and their runs
# on tensors of a few thousand numbers barely notice (the whole suite: a fifth less time). A file
# whose tests run many steps on the demo model (its 201,088-token vocabulary makes each step's
# logits and token picks the costly part) is marked `pytest.mark.optimized` and compiles at XLA's
# default level (`_optimisation_level` below): tests/test_server.py took 120 s at it against 194 s.
# A test that runs many steps of its own programs may carry the mark alone (the tiny model's 40
# training steps on text: 26 s against 35 s).
# XLA's CPU backend uses no fast-math at any level, so what the programs compute differs at most by
# the float noise the tests measure: every test asserts the same at either level.
# Through JAX's `jax_disable_most_optimizations` (level 0, and LLVM's expensive passes left out), read
# at each compilation: in the tests' processes by file (below), in the commands they start through
# its environment variable, JAX_DISABLE_MOST_OPTIMIZATIONS, which they inherit or command_env passes.
# A level given in XLA_FLAGS stands for every file and command (the GPU tests, say:
# XLA_FLAGS=--xla_backend_optimization_level=3 pytest -m gpu).
_level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level=")]
LEVEL_GIVEN = bool(_level)
if not LEVEL_GIVEN:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
jax.config.update("jax_disable_most_optimizations", not LEVEL_GIVEN)
# The command line keeps compiled steps in the user's cache folder (JAX's persistent compilation
# cache, $XDG_CACHE_HOME/gptoss-jax/xla). The tests never write into the home of whoever runs them:
# XDG_CACHE_HOME is .pytest_cache/home in the checkout (pytest-xdist's workers and the commands the
# tests start inherit it), kept between runs, and the tests' own processes compile into the same
# folder by the same path. The same path, not a link to it: JAX's key for a program holds the
# program, its compile options and the versions of jax and XLA, and the compile options name a
# subfolder of the cache folder as written, so a link or another spelling of the folder is a cache
# of its own (cli/devices.py resolves links for the same reason). So the tests and the commands they
# start share one cache: a program compiled once, in this run or an earlier one, is read back instead
# of compiled again, and a second call of the fast tier compiles only what changed. The run's first
# process trims the folder to XLA_CACHE_BYTES, the least recently used entries first.
# conftest.compile_events counts reads from the cache as compilations.
CACHE_HOME = os.path.join(os.path.realpath(ROOT), ".pytest_cache", "home")
XLA_CACHE = os.path.join(CACHE_HOME, "gptoss-jax", "xla")
XLA_CACHE_BYTES = 3 << 30


def _trim(folder: str, limit: int) -> None:
    """Remove the least recently used files of `folder` until the rest holds at most `limit` bytes."""
    entries = []
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):
            info = entry.stat()
            entries.append((max(info.st_atime, info.st_mtime), info.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            os.remove(path)
            total -= size


if os.environ.get("XDG_CACHE_HOME") != CACHE_HOME:  # the run's first process
    shutil.rmtree(os.path.join(ROOT, ".pytest_cache", "xla"), ignore_errors=True)  # where it was kept before
    os.makedirs(XLA_CACHE, exist_ok=True)
    _trim(XLA_CACHE, XLA_CACHE_BYTES)
    os.environ["XDG_CACHE_HOME"] = CACHE_HOME
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

sys.path.insert(0, os.path.dirname(__file__))  # for refs.py

import gptoss_jax as gj  # noqa: E402
from gptoss_jax.testing import random_params  # noqa: E402


# The genuine vocabulary, beside the checkout (GPTOSS_TEST_VOCAB names another place: tests/test_suite.py
# points it at nothing to check that collection never needs it).
VOCAB = os.environ.get("GPTOSS_TEST_VOCAB") or os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "tokenizer", "o200k_base.tiktoken")
needs_vocab = pytest.mark.skipif(not os.path.isfile(VOCAB), reason=(
    f"the genuine o200k_base vocabulary is not at {os.path.normpath(VOCAB)}: download o200k_base.tiktoken "
    f"(docs/generating.md, 'Getting started with the real models', says from where) and put it there"))


def pytest_configure(config):
    """The GPU tests are deselected unless the marker expression names them: `pytest` runs the CPU suite,
    `pytest -m "not slow"` its fast tier, `pytest -m gpu` the GPU tests."""
    expr = config.option.markexpr
    if "gpu" not in expr:
        config.option.markexpr = f"({expr}) and not gpu" if expr else "not gpu"


# The files that take longest, longest first (measured on 2 cores): pytest-xdist gives each worker a
# whole file at a time (--dist loadfile, so a file's compiled steps and fixtures are made once), in the
# order collected, so these go first and the short files fill in at the end. Only the wall time depends
# on this order.
LONGEST_FILES = ("test_server.py", "test_serving_speculation.py", "test_run_inference.py", "test_training.py",
                 "test_sharding.py", "test_training_sharded.py", "test_docs.py", "test_eagle3.py",
                 "test_packed_experts.py", "test_speculative.py", "test_paged.py", "test_convert.py",
                 "test_serving.py", "test_served_adapters.py", "test_server_bounds.py", "test_serve_command.py", "test_serving_eagle3.py",
                 "test_convert_interrupts.py", "test_clients.py", "test_generate.py", "test_finetune.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


def pytest_collection_finish(session):
    """Python's cycle collector, out of the tracing's way. Tracing a model to a program makes and drops
    millions of small objects, and each of the collector's full passes walked everything the test
    files imported (jax, torch, transformers: about 240,000 objects in a worker), which lives until the
    process ends. Those are frozen once collected (left out of every later pass), and a pass starts
    after 20,000 new objects rather than 700: tests/test_generate.py spent 4.1 to 4.5 s of its 45 in
    the collector, 1.5 s after this (the same tests, collected and freed alike)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


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


def command_env(**extra: str) -> dict:
    """The environment for a command a test starts as a process: this one's without its JAX settings
    and XLA flags (the command's own flags choose its devices), the tests' optimisation level kept
    (see the top of this file: the lowest, in the optimized files too), the older CPU emitters where
    the tests use them (EMITTERS), and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    flags = " ".join(f for f in (_level[-1] if LEVEL_GIVEN else "", EMITTERS) if f)
    level = {} if LEVEL_GIVEN else {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    return {**env, **level, **({"XLA_FLAGS": flags} if flags else {}), **extra}


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for the coordinator of several local processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def optimisation_level(lowest: bool):
    """What compiles inside the block does so at the tests' lowest level or at XLA's default (a level
    given in XLA_FLAGS stands for both); the level before is put back after it. For instance, in a
    test marked `pytest.mark.optimized`, what it runs once, such as a model's random init, whose
    compile the default level makes several times longer: `with optimisation_level(lowest=True)`."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", lowest and not LEVEL_GIVEN)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True, scope="module")
def _optimisation_level(request):
    """A file marked `pytest.mark.optimized` compiles at XLA's default level (see the top of this
    file); the others at the lowest, unless XLA_FLAGS gives a level."""
    with optimisation_level(lowest=request.node.get_closest_marker("optimized") is None):
        yield


@pytest.fixture(autouse=True)
def _optimisation_level_of_a_test(request, _optimisation_level):
    """A test marked `pytest.mark.optimized` in a file that is not marked compiles what it compiles
    itself at XLA's default level (the commands it starts stay at the lowest: command_env); what the file's
    fixtures compiled before it stays as it was."""
    lowest = jax.config.read("jax_disable_most_optimizations")
    with optimisation_level(lowest=lowest and request.node.get_closest_marker("optimized") is None):
        yield


@pytest.fixture(autouse=True)
def _every_program_kept_in_the_shared_cache():
    """A command run in the test's own process (`main([...])`) sets JAX's persistent cache up for itself:
    programs compiled in under half a second are not written (cli/devices.py). Put back after the
    test, or every file after it on the same worker would compile its small programs again on every
    run (about 1,700 of them in the fast tier, two minutes of a 2-core machine)."""
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


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


# The tiny model with two layers, one of each kind (a sliding window of 16, then full attention), for
# the tests of what runs around the layers rather than in them: the serving engine's scheduling,
# speculative decoding's drafts, acceptance and roll-back, and the layouts on a mesh
# (tests/test_serving.py, tests/test_speculative.py, tests/test_serving_speculation.py,
# tests/test_sharding.py, tests/test_training_sharded.py). Their compile time follows the layers (a
# checked step holds the model twice): alone, with an empty compilation cache, the first three files
# took 65, 58 and 92 s with two layers against 80, 98 and 153 s with four, the two sharded ones 143 s
# against 190 s over 2 workers. What only more layers of a
# kind would show (a step that rolls back, reads or writes some layers' caches and not the others')
# is left to the files that run four: tests/test_generate.py, tests/test_cache.py, tests/test_paged.py,
# and for speculation tests/test_eagle3.py, tests/test_serving_eagle3.py and tests/test_run_inference.py.
TWO_LAYERS = gj.ModelConfig.tiny().replace(num_hidden_layers=2)


@pytest.fixture(scope="session")
def two_layers_f32():
    """(TWO_LAYERS, its float32 parameters)."""
    return TWO_LAYERS, random_params(TWO_LAYERS, seed=3, dtype=jnp.float32)


@pytest.fixture(scope="session")
def long_tokens(tiny):
    # 300 tokens: 18x the tiny window (16) and past its YaRN initial context (256).
    return np.random.default_rng(1).integers(0, tiny.vocab_size, size=(1, 300)).astype(np.int32)


# What JAX records when it makes an executable: compiled by XLA, or read from the persistent compilation
# cache the tests share (a step compiled by an earlier test would otherwise pass unnoticed).
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


@contextlib.contextmanager
def compile_events():
    """-> a list of the durations of the executables JAX makes while the block runs, compiled or read
    from the persistent cache."""
    compiles, listening = [], [True]

    def listen(event, duration, **_):  # a listener cannot be removed on every JAX version: it stops listening
        if listening[0] and event in COMPILE_EVENTS:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        listening[0] = False


def until(condition, what: str, timeout: float = 60, every: float = 0.01):
    """Polls `condition()` until it returns something true, and returns that; fails naming `what` if
    `timeout` seconds pass first. The one way the tests wait for another thread or process to reach a
    state (tests/test_suite.py holds that no other sleep waits): the timeout only ends a test
    that would hang, so it is generous, never a bound on how fast anything must be."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {timeout} s: {what}")
        time.sleep(every)
    return got


def wait_for_signal_handlers(process, timeout: float = 30) -> None:
    """Until the command has installed its SIGINT/SIGTERM handlers (Python alone catches no SIGTERM):
    before that, only Python's own start-up runs, which no program can guard."""
    def caught() -> bool:
        assert process.poll() is None, "the command ended before it installed its signal handlers"
        with open(f"/proc/{process.pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        return bool(mask & (1 << (signal.SIGTERM - 1)))

    until(caught, "the command installed its signal handlers", timeout)
