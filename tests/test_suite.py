"""The suite's own rules (docs/testing.md): no test waits by sleeping, collection never fails for want
of the vocabulary, and the 8 CPU devices of the sharded tests never starve XLA's thread pool."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
NOT_A_WAIT = "not a wait"


def sleeps(source: str, path: str) -> list[tuple[int, str]]:
    """(line, text) of every call of a `sleep` (time.sleep, asyncio.sleep, a bare sleep) that is neither
    in conftest.until nor marked on its line with a comment saying `not a wait` and what it paces."""
    tree = ast.parse(source, path)
    lines = source.splitlines()
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "until" and os.path.basename(path) == "conftest.py":
            allowed.update(range(node.lineno, node.end_lineno + 1))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name != "sleep" or node.lineno in allowed:
            continue
        line = lines[node.lineno - 1]
        if NOT_A_WAIT not in line.partition("#")[2]:
            out.append((node.lineno, line.strip()))
    return out


def test_no_test_waits_by_sleeping():
    """A test that sleeps to let another thread or process reach a state races the clock: on a slower or
    busier machine the state comes later. Waits go through conftest.until (poll a condition, a timeout
    only against hanging); a sleep that paces something (a client trickling bytes, a stand-in engine's
    work) says so on its line: `# not a wait: ...`."""
    found = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py"):
            path = os.path.join(TESTS, name)
            found += [f"tests/{name}:{line}: {text}" for line, text in sleeps(open(path).read(), path)]
    assert not found, "sleeps that wait (use conftest.until, or mark pacing `# not a wait: why`):\n" + "\n".join(found)


def test_a_planted_sleeping_wait_is_found():
    planted = ("import time, asyncio\n"
               "def f(x):\n"
               "    time.sleep(0.2)\n"
               "    time.sleep(0.1)  # not a wait: paces the client\n"
               "    asyncio.sleep(1)  # waits for the server\n")
    assert [line for line, _ in sleeps(planted, "tests/test_x.py")] == [3, 5]
    until = "import time\ndef until(c):\n    time.sleep(0.01)\n"
    assert sleeps(until, "tests/conftest.py") == [] and len(sleeps(until, "tests/test_x.py")) == 1


@pytest.mark.slow  # imports every test file (JAX, torch, transformers) in a fresh interpreter: 10 to 25 s
def test_collection_without_the_vocabulary_never_fails(tmp_path):
    """With the o200k_base vocabulary missing, every test file is still collected without an error (the
    tests that need it carry conftest.needs_vocab, a skip with the reason)."""
    env = dict(os.environ, GPTOSS_TEST_VOCAB=str(tmp_path / "o200k_base.tiktoken"))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "error" not in done.stdout.splitlines()[-1], done.stdout[-3000:] + done.stderr


INDEPENDENT_COLLECTIVES = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
every = P(("a", "b", "c"))
def step(*xs):  # twelve all-reduces that depend on nothing but their own input
    return tuple(jax.lax.psum(jnp.sin(x) @ x, "abc"[i % 3]) for i, x in enumerate(xs))
run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(every,) * 12, out_specs=(every,) * 12, check_vma=False))
xs = [jax.device_put(jnp.full((8 * 64, 64), i / 12), NamedSharding(mesh, every)) for i in range(12)]
for _ in range(200):  # dispatched ahead: many runs wait for threads at once
    out = run(*xs)
jax.block_until_ready(out)
print("done")
"""


def test_eight_cpu_devices_run_independent_collectives_without_starving_xla(tmp_path):
    """The sharded tests run 8 CPU devices in one process. Programs of independent all-reduces dispatched
    ahead on them can deadlock XLA's thread pool at its default size (as many threads as devices): the
    process aborts after 40 s (3 of 3 runs of this test without conftest's NPROC). conftest gives the
    pool twice that through NPROC, and the processes the tests start inherit it."""
    script = tmp_path / "collectives.py"
    script.write_text(INDEPENDENT_COLLECTIVES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]


READ_BACK = """
import sys, jax, jax.numpy as jnp
from gptoss_jax.cli import devices
devices.use_compile_cache(sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # (the command line keeps only programs of 0.5 s or more)
x = jnp.arange(8.0)
made = []
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: made.append(event))
a, b, c = (float(n) for n in sys.argv[1].split(","))  # each whole and below 2^21: exact in float32
def shared_program(x):
    return jnp.sin(x) * a + b + c
jax.jit(shared_program)(x).block_until_ready()
print("read back" if "/jax/compilation_cache/cache_retrieval_time_sec" in made else "compiled")
"""


def test_commands_share_the_tests_compilation_cache_whatever_path_reaches_it(tmp_path):
    """The tests and the commands they start compile into one folder (conftest.py), kept between runs:
    a command run in the test's own process uses the folder the tests use, by the same path (JAX's
    key names the folder as written), and a command started as a process reads back what another
    compiled, through the folder the command line picks by default or through a link to it
    (cli/devices.py resolves links). A new constant each run: the program is never in the cache
    beforehand. (A command started as a process has one CPU device, the tests' processes eight: JAX
    keys programs by the devices too, so those two never share programs.)"""
    import jax

    from conftest import command_env
    from gptoss_jax.cli import devices

    default = os.path.expanduser(devices.default_compile_cache())
    assert default == os.path.realpath(default) == jax.config.jax_compilation_cache_dir
    os.symlink(default, tmp_path / "link")
    script = tmp_path / "read_back.py"
    script.write_text(READ_BACK)
    # Constants no earlier run compiled: the clock in nanoseconds, 21 bits a constant, so that float32
    # (the program's type) holds each exactly (the clock as one float32 repeats for two minutes).
    now = time.time_ns()
    scale = ",".join(str((now >> shift) & (2**21 - 1)) for shift in (0, 21, 42))
    got = [subprocess.run([sys.executable, str(script), scale, where], cwd=ROOT, env=command_env(),
                          capture_output=True, text=True, timeout=300) for where in (default, str(tmp_path / "link"))]
    assert [done.returncode for done in got] == [0, 0], got[0].stderr[-3000:] + got[1].stderr[-3000:]
    assert [done.stdout.strip() for done in got] == ["compiled", "read back"]
