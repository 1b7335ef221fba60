"""Which devices the command line runs on: several processes (jax.distributed) and the mesh.

Everything here is checked before any weight is read: the process flags (with no JAX), then the
mesh against the devices and the model (JAX starts, nothing is loaded). Hence JAX and the library
are imported inside the functions that need them, never when this module loads.
"""

from __future__ import annotations

import os
import sys

from ..config import ModelConfig
from ..layout import MESH_AXES, check_sizes, default_sizes, parse_mesh
from .inputs import UsageError

# The environment variables read when no process flag is given (JAX reads the first one itself too).
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def add_flags(parser) -> None:
    group = parser.add_argument_group(
        "several devices and hosts",
        "Every device of every process is used. With several processes (hosts), start the same command on\n"
        "each, with --coordinator, --num-processes and --process-id (or the environment variables\n"
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}), or with --distributed\n"
        "where JAX finds them itself (Cloud TPU VMs, SLURM, Open MPI). Only process 0 prints.")
    group.add_argument("--mesh", metavar="AXES",
                       help=f"device layout as {','.join(a + '=N' for a in MESH_AXES)} (axes left out are 1; the "
                            "product must be the device count). data splits the batch, expert the experts, "
                            "tensor the heads, the expert intermediate size and the vocabulary. Default: the "
                            "experts split first, then tensor within each host, then data")
    group.add_argument("--compile-cache", metavar="DIR", default=default_compile_cache(),
                       help="keep compiled steps here, so that the next start with the same model, shapes and "
                            "devices skips compilation; 'none' turns it off (default: %(default)s)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0, reachable from every process")
    group.add_argument("--num-processes", type=int, metavar="N", help="how many processes take part")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1")
    group.add_argument("--distributed", action="store_true",
                       help="start jax.distributed and let it find the processes (TPU VM slices, SLURM, Open MPI)")


def mesh_sizes(args) -> dict[str, int] | None:
    """--mesh as axis sizes (None: not given), its names and numbers checked."""
    if args.mesh is None:
        return None
    try:
        return parse_mesh(args.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {args.mesh}: {e}") from None


def process_settings(args) -> dict | None:
    """The jax.distributed.initialize arguments the flags (or environment) ask for; None: one process."""
    flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    given = [name for name, value in flags.items() if value is not None]
    if given:
        if len(given) < 3:
            missing = [name for name in flags if name not in given]
            raise UsageError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} {' and '.join(missing)} too")
        coordinator, n, i = args.coordinator, args.num_processes, args.process_id
        where = "--coordinator"
    elif os.environ.get(ENV_COORDINATOR):
        coordinator = os.environ[ENV_COORDINATOR]
        n = _env_int(ENV_NUM_PROCESSES)
        i = _env_int(ENV_PROCESS_ID)
        where = ENV_COORDINATOR
    elif args.distributed:
        return {}
    else:
        return None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"{where}: expected HOST:PORT, got {coordinator!r}")
    if n is not None and n < 1:
        raise UsageError(f"--num-processes must be at least 1, got {n}")
    if i is not None and n is not None and not 0 <= i < n:
        raise UsageError(f"--process-id must lie in [0, {n - 1}] for {n} processes, got {i}")
    return {"coordinator_address": coordinator, "num_processes": n, "process_id": i}


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name}: expected an integer, got {value!r}") from None


def default_compile_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(base, "gptoss-jax", "xla")


def use_compile_cache(folder: str) -> None:
    """JAX's persistent compilation cache in `folder` (created if needed; 'none': off)."""
    if folder.lower() == "none":
        return
    import jax

    folder = os.path.expanduser(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--compile-cache {folder}: cannot create it ({e.strerror}); pass another folder "
                         f"or 'none'") from None
    # JAX keys each program by its compile options too, and they name a subfolder of the cache folder
    # as written: the folder's real path, so that a link to it and the folder itself share entries.
    jax.config.update("jax_compilation_cache_dir", os.path.realpath(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def start_processes(settings: dict | None) -> None:
    """Join the other processes (if any) before JAX picks its devices."""
    if settings is None:
        return
    import jax

    # On CPU the processes exchange data through gloo (it changes nothing on GPUs and TPUs).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _keep_stdout_for_python()
    try:
        jax.distributed.initialize(**settings)
    except Exception as e:  # connection refused, timeouts, a cluster that cannot be detected
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot join the other processes: {first}") from None


def choose_mesh(sizes: dict[str, int] | None, config: ModelConfig, *, dtype="bfloat16"):
    """The mesh to run on (None: one device), checked against the devices and the model's parameters
    of this dtype ("mxfp4": its experts packed); sizes None: the default layout."""
    import jax

    from ..params import check_mesh
    from ..sharding import make_mesh

    count = jax.device_count()
    flag = "--mesh" if sizes else "the default mesh"
    sizes = sizes or default_sizes(config, count, jax.local_device_count(), dtype=dtype)
    try:
        check_mesh(config, sizes, dtype=dtype)
        check_sizes(sizes, count)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if count == 1:
        return None
    return make_mesh(**sizes)


def unsplit_batch(batch: int, mesh, what: str) -> str | None:
    """A warning when the mesh's `data` axis does not divide a batch (what: how the user names it);
    None when it does. Every data slice then computes the whole batch."""
    data = mesh.shape["data"] if mesh is not None else 1
    if batch % data:
        return f"{what} does not split over data={data}: every data slice computes all of it"
    return None


def quiet_other_processes() -> bool:
    """Only process 0 prints: the others' standard output goes nowhere. True on process 0."""
    import jax

    if jax.process_index() == 0:
        return True
    sys.stdout = open(os.devnull, "w")
    os.dup2(sys.stdout.fileno(), 1)
    return False


def _keep_stdout_for_python() -> None:
    """Native libraries print notices on standard output (gloo announces each connection); send those
    to standard error, so that standard output carries only the program's text and JSON."""
    sys.stdout.flush()
    own = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(own, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                      buffering=1 if os.isatty(own) else -1)
