"""The serving command line: `gptoss-serve` (and `python -m gptoss_jax.serving`).

Like the generation command, every flag is checked before JAX or the model loads. The server
listens at once, answering 503 on /health until the engine has compiled its steps, then prints one
line with its URL. SIGTERM or Ctrl-C: it stops listening, lets running requests finish for
--grace seconds, and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..metadata import expand
from ..version import __version__
from ..cli import devices
from ..cli.command import leave, run_command
from ..cli.inputs import UsageError, max_context, model_config
from ..cli.signals import Signals

DESCRIPTION = """\
Serve gpt-oss over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
/v1/responses, /v1/models, /health and /metrics (Prometheus). Requests are batched continuously:
each takes one of --slots KV cache slots as soon as one is free.

With no --checkpoint, the built-in tiny demo model with RANDOM weights is served (its replies are
meaningless), so the whole path can be tried on a CPU in seconds.

examples:
  %(prog)s                                                   # the demo model on 127.0.0.1:8000
  %(prog)s --checkpoint CKPT --tokenizer o200k_base.tiktoken --slots 64 --served-model-name gpt-oss-20b
  %(prog)s --checkpoint CKPT --dtype mxfp4 --host 0.0.0.0 --api-key "$KEY"
  %(prog)s --checkpoint CKPT --coordinator host0:1234 --num-processes 2 --process-id 0   # on host 0
  %(prog)s --checkpoint CKPT --coordinator host0:1234 --num-processes 2 --process-id 1   # on host 1

With several processes (hosts), process 0 listens and takes the requests; the others run the same
engine steps over their devices and stop when process 0 stops.

then, with the openai client:
  client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "Hi"}])
"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", type=expand,
                   help="a converted gptoss-jax checkpoint (default: the demo model)")
    p.add_argument("--tokenizer", metavar="PATH", type=expand,
                   help="o200k_base.tiktoken (or its folder), hash-checked; default: $TIKTOKEN_ENCODINGS_BASE or "
                        "tiktoken's cache")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "mxfp4"], default=None,
                   help="parameter and activation dtype (default: bfloat16; float32 for the demo model); mxfp4: the "
                        "experts stay packed in MXFP4 on the device, the rest bfloat16")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0 for every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--slots", type=int, default=16,
                   help="requests generated at once, each holding one KV cache slot of --max-context tokens "
                        "(default: %(default)s)")
    p.add_argument("--max-context", type=int, default=None,
                   help="each slot's length: prompt plus reply must fit (default: 4096, or the model's context if "
                        "shorter)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued for a slot; beyond that the server answers 429 (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens of each request prefilled per engine step (default: %(default)s)")
    p.add_argument("--prefill-rows", type=int, default=4,
                   help="prompts prefilled together per engine step (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the checkpoint folder's name, "
                        "or gpt-oss-demo)")
    p.add_argument("--api-key", default=None,
                   help="a key clients must send (Authorization: Bearer KEY); default: $GPTOSS_API_KEY, else none")
    p.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds given to running requests before exiting (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no loading progress bar")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    devices.add_flags(p)
    return p


def check_flags(args) -> None:
    for flag, value, least in (("--slots", args.slots, 1), ("--prefill-chunk", args.prefill_chunk, 1),
                               ("--prefill-rows", args.prefill_rows, 1), ("--max-waiting", args.max_waiting, 0)):
        if value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.grace < 0:
        raise UsageError(f"--grace must be at least 0, got {args.grace}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be at least 2, got {args.max_context}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return run_command(lambda: build_parser(prog).parse_args(argv), _run, raising=True)


def entry(prog: str | None = None) -> None:
    """The program's entry point (`gptoss-serve`, `python -m gptoss_jax.serving`)."""
    leave(main(prog=prog or os.path.basename(sys.argv[0])))


def _say(text: str) -> None:
    print(f"gptoss-serve: {text}", file=sys.stderr, flush=True)


def _run(args, signals: Signals) -> int:
    # Start-up: tiktoken and the library load here, after argparse has checked the flags.
    from .. import tokenizer as tk

    check_flags(args)
    processes = devices.process_settings(args)
    mesh_sizes = devices.mesh_sizes(args)
    config, what = model_config(args)
    max_len = max_context(args, config)
    if config.vocab_size != tk.VOCAB_SIZE:
        raise UsageError(f"this model's vocabulary has {config.vocab_size} tokens, not o200k_harmony's "
                         f"{tk.VOCAB_SIZE}: the OpenAI API needs the harmony tokenizer")
    tokenizer = tk.load_tokenizer(args.tokenizer)
    tk.harmony_encoding(args.tokenizer)  # checked now, not at the first request
    api_key = args.api_key if args.api_key is not None else os.environ.get("GPTOSS_API_KEY") or None
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                                      else "gpt-oss-demo")

    # JAX starts here, once everything that can be checked without it has been.
    import jax

    from ..cli.generate import _experts, _load_params
    from ..serving import Engine
    from ..serving.lockstep import LockstepError
    from ..sharding import describe
    from .app import Server, create_app, serve_forever

    devices.use_compile_cache(args.compile_cache)
    devices.start_processes(processes)
    mesh = devices.choose_mesh(mesh_sizes, config, experts=_experts(args))
    main_process = devices.quiet_other_processes()  # only process 0 listens and speaks
    args.quiet = args.quiet or not main_process
    unsplit = devices.unsplit_batch(args.slots, mesh, f"--slots {args.slots}")
    if main_process:
        if unsplit:
            _say(f"warning: {unsplit}")
        experts = "; experts packed in MXFP4" if _experts(args) else ""
        _say(f"model: {what}{experts}; jax {jax.__version__}; {args.slots} slots of {max_len} tokens")
        _say(f"devices: {describe(mesh, config) if mesh else '1 ' + jax.devices()[0].platform + ' device'}")
    params = _load_params(args, config, mesh)
    engine = Engine(config, params, slots=args.slots, max_len=max_len, prefill_chunk=min(args.prefill_chunk, max_len),
                    prefill_rows=args.prefill_rows, max_waiting=args.max_waiting, tokenizer=tokenizer)
    if not main_process:
        return _follow(engine, signals, LockstepError)
    server = Server(engine, tokenizer, args.tokenizer, model_name=name, api_key=api_key)
    app = create_app(server)
    listening = threading.Event()
    url = {}

    def warm_up():
        try:
            _say("compiling the engine's steps (the server answers 503 until they are ready)")
            compiled = engine.warm_up()
            engine.start()
        except Exception as e:  # noqa: BLE001 — said, and the server stops
            _say(f"error: warming up failed: {type(e).__name__}: {e}")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        server.ready.set()
        listening.wait()
        _say(f"compiled: {'; '.join(compiled)}")
        print(f"gptoss-serve: ready at {url['base']} (model {name!r})", flush=True)

    def on_started(uvicorn_server):
        host = "[" + args.host + "]" if ":" in args.host else args.host
        port = uvicorn_server.servers[0].sockets[0].getsockname()[1] if uvicorn_server.servers else args.port
        url["base"] = f"http://{host}:{port}/v1"
        listening.set()

    def stopping():
        server.stopping = True

    threading.Thread(target=warm_up, name="gptoss-warm-up", daemon=True).start()
    # From here uvicorn takes SIGINT and SIGTERM (graceful shutdown), and raises the signal again once
    # it has stopped: these handlers take it then, so that the command exits 0.
    signals.restore()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    serve_forever(app, args.host, args.port, args.grace, on_started, on_exit=stopping)
    server.stopping = True
    engine.stop(cancel=True)
    _say("stopped")
    return 0


def _follow(engine, signals: Signals, lost: type[Exception]) -> int:
    """A process other than 0: the same steps as process 0, until it stops. SIGINT and SIGTERM are
    left to process 0 (stopping here alone would hang the others' collectives)."""
    import jax

    engine.warm_up()
    signals.restore()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        engine.follow()
    except lost as e:
        _say(f"error: process {jax.process_index()}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    entry()
