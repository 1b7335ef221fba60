"""The serving command line: `gptoss-serve` (and `python -m gptoss_jax.server`).

Like the generation command, every flag is checked before JAX or the model loads; then the port is
taken, before anything loads (in use: one line, exit 1). The server answers 503 on /health until the
engine has compiled its steps, then prints one line with its URL. SIGTERM or Ctrl-C, at any moment:
it stops listening, lets running requests run for --grace seconds, ends those still running with
their last chunk, and exits 0. A warm-up that fails exits 1.
"""

from __future__ import annotations

import argparse
import errno
import gc
import ipaddress
import math
import os
import signal
import sys
import threading

from ..cli import devices, inputs, loading
from ..cli.command import leave, run_command
from ..cli.inputs import (DRAFT_CHOICES, UsageError, check_draft_form, check_head, draft_flag, head_folder,
                          model_config)
from ..hostmem import return_large_blocks
from ..metadata import expand
from ..serving.config import EngineConfig
from ..serving.scheduler import MANY_SLOTS, PREFILL_ROWS
from ..signals import Signals, say
from ..version import __version__
from . import lora_flags
from .startup import check_pool, kv_cache_line

DESCRIPTION = """\
Serve gpt-oss over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
/v1/responses, /v1/models, /health and /metrics (Prometheus). Requests are batched continuously:
up to --slots generate at once, their keys and values held in a pool of KV cache pages taken as
they grow. Pages stay cached after their request ends, so a prompt that begins as an earlier one
did (the same system prompt and tools, a conversation's next turn) computes only the rest.

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

then, with the openai client (the demo model's name is gpt-oss-demo; --served-model-name sets another):
  client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="gpt-oss-demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=64)

SIGTERM or Ctrl-C stops the server at any moment, with exit status 0: running requests get --grace
seconds, then those still running end with their last chunk (finish_reason "length"). A port in use
or a warm-up that fails: one line, exit status 1.
"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_flags(p)
    loading.add_kv_flag(p)
    lora_flags.add_flags(p)
    p.add_argument("--tokenizer", metavar="PATH", type=expand,
                   help="o200k_base.tiktoken (or its folder), hash-checked; default: $TIKTOKEN_ENCODINGS_BASE, "
                        "tiktoken's cache, else downloaded once into that cache")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0 for every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--slots", type=int, default=None,
                   help="sequences generated at once; their memory is the KV cache's pages (--kv-memory-gb), "
                        "taken as they grow (default: where the device says its memory, as a GPU does, one per "
                        "2,048 tokens the KV cache holds, a power of two from 16 to 1,024; else 16). The "
                        "start-up line says how many it took")
    p.add_argument("--max-context", type=int, default=None,
                   help="the longest request: prompt plus reply must fit (default: the model's context, 131,072 "
                        "tokens for gpt-oss); it sets no memory aside")
    p.add_argument("--kv-memory-gb", type=float, default=None, metavar="GIB",
                   help="the KV cache's pool of pages, in GiB (2^30 bytes), whole: each device holds all of it, or "
                        "its share of the KV heads with --mesh tensor=N (default: 85%% of the memory the first "
                        "device has free once the weights are loaded; on a CPU, room for --slots sequences of 8,192 "
                        "tokens and one of --max-context)")
    p.add_argument("--page-size", type=int, default=EngineConfig.page_size, metavar="POSITIONS",
                   help="positions of one KV cache page, a multiple of 8: the unit of memory taken and of prefixes "
                        "reused (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt whole, even where its beginning is cached (for comparison)")
    p.add_argument("--draft", type=draft_flag, default="none", metavar="DRAFT",
                   help=f"speculative decoding while few requests decode (--speculate-rows), {DRAFT_CHOICES}: "
                        "each step checks up to --draft-tokens proposed tokens per request in one pass and keeps "
                        "those the model agrees with. prompt-lookup proposes what followed the latest earlier "
                        "occurrence of the last tokens (pays off on edits, code, quoting); eagle3:DIR drafts with a "
                        "published EAGLE-3 head (the folder run_inference.py takes) from the model's own hidden "
                        "states, on the device. A request whose drafts miss drafts again after 2, 4, 8, then 16 "
                        "steps. Greedy replies are unchanged; sampled ones keep their distribution, not their draws. "
                        "Requests with logprobs, a logit bias, penalties or a grammar are not speculated "
                        "(default: none)")
    p.add_argument("--draft-tokens", type=int, default=EngineConfig.draft_tokens, metavar="K",
                   help="with --draft: tokens proposed per request and step, less than --prefill-chunk "
                        "(default: %(default)s)")
    p.add_argument("--speculate-rows", type=int, default=EngineConfig.speculate_rows, metavar="N",
                   help="with --draft: steps speculate only while at most N requests decode; past that a step's "
                        "work grows with its positions and speculation costs throughput (default: %(default)s)")
    p.add_argument("--speculate-steps", type=int, default=None, metavar="S",
                   help="with --draft: 0 drafts on the host, a step at a time; S > 0 drafts on the device and, while "
                        "no prompt is being prefilled or waits, runs up to S checked steps in one call, no more than "
                        "--prefill-chunk / (K + 1) (measured faster than drafting on the host where drafts are "
                        "mostly right, slower where they are mostly wrong: docs/serving.md). A request that stops "
                        "mid-call has its later tokens dropped; a request that arrives waits at most for the call "
                        f"(default: {EngineConfig.speculate_steps} with prompt-lookup; {HEAD_STEPS} with eagle3, "
                        "which drafts on the device only)")
    p.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting,
                   help="requests queued while every slot is taken or the KV cache is full; beyond that the server "
                        "answers 429 (0: none waits, a request is taken only by a free slot) (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help="prompt tokens of each request prefilled per engine step (default: %(default)s)")
    p.add_argument("--prefill-rows", type=int, default=None, help=f"prompts prefilled together per engine step "
                   f"(default: {PREFILL_ROWS[0]}, or {PREFILL_ROWS[1]} with {MANY_SLOTS} slots or more)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the checkpoint folder's name, "
                        "or gpt-oss-demo)")
    p.add_argument("--api-key", default=None,
                   help="a key clients must send to the /v1 endpoints (Authorization: Bearer KEY; /health, /metrics "
                        "and /openapi.json stay open); default: $GPTOSS_API_KEY, else none: whoever reaches the port "
                        "can use the model")
    p.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds given to running requests; those still running then end at "
                        "once, each stream with its last chunk (finish_reason \"length\") and [DONE] (default: "
                        "%(default)s)")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a client has this long to send a request's headers (from connecting, or from the end of its "
                        "previous reply), then as long again for its body; a slower one gets 408 and is disconnected, "
                        "so that silent clients cannot hold connections (default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections at most (streaming, waiting or idle); one more is answered 503 with "
                        "Retry-After and closed (default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                   help="the largest request body taken, in MiB (2^20 bytes); a larger one is refused with 413 before "
                        "it is read (default: %(default)g)")
    p.add_argument("--allowed-hosts", metavar="NAMES",
                   help="the Host header names accepted, comma-separated (* for any); requests naming another get "
                        "400. Default: while --host is a loopback address, only localhost, 127.0.0.1 and ::1 (a web "
                        "page a browser visits then cannot reach the server by DNS rebinding), else any")
    p.add_argument("--stored-responses", type=int, default=1024, metavar="N",
                   help="Responses API replies kept in memory for previous_response_id and GET /v1/responses/{id} "
                        "(store: true, the default), the oldest forgotten first; 0 keeps none (default: %(default)s)")
    p.add_argument("--store-mb", type=float, default=1024.0, metavar="MB",
                   help="the most memory the stored responses take, in MiB of their JSON (a response echoes the "
                        "request's tools and instructions); the oldest are forgotten first, and a response larger "
                        "than this alone is not stored (default: %(default)g)")
    p.add_argument("--stored-seconds", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a stored response is kept (default: %(default)g)")
    p.add_argument("--quiet", action="store_true", help="no loading progress bar")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    devices.add_flags(p)
    return p


def engine_options(args, max_len: int) -> EngineConfig:
    """The engine's settings from the flags (their defaults are EngineConfig's)."""
    return EngineConfig(slots=args.slots, max_len=max_len, prefill_chunk=min(args.prefill_chunk, max_len),
                        prefill_rows=args.prefill_rows, max_waiting=args.max_waiting, page_size=args.page_size,
                        kv_memory=None if args.kv_memory_gb is None else int(args.kv_memory_gb * 2**30),
                        kv_dtype=args.kv_dtype,
                        prefix_reuse=not args.no_prefix_cache, draft_tokens=args.draft_tokens,
                        speculate_rows=args.speculate_rows, speculate_steps=speculate_steps(args))


HEAD_STEPS = 4  # checked steps a call by default with an EAGLE-3 head


def speculate_steps(args) -> int:
    """--speculate-steps, or its default for the draft source (a head drafts on the device only)."""
    if args.speculate_steps is not None:
        return args.speculate_steps
    return HEAD_STEPS if head_folder(args) else EngineConfig.speculate_steps


def check_flags(args) -> None:
    for flag, value, least in (("--slots", 1 if args.slots is None else args.slots, 1), ("--page-size", args.page_size, 1),
                               ("--prefill-chunk", args.prefill_chunk, 1), ("--max-waiting", args.max_waiting, 0),
                               ("--prefill-rows", 1 if args.prefill_rows is None else args.prefill_rows, 1),
                               ("--max-connections", args.max_connections, 1),
                               ("--stored-responses", args.stored_responses, 0),
                               ("--draft-tokens", args.draft_tokens, 1), ("--speculate-rows", args.speculate_rows, 1),
                               ("--speculate-steps", speculate_steps(args), 0)):
        if value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.grace < math.inf:
        raise UsageError(f"--grace must be a number of seconds, at least 0, got {args.grace}")
    if args.page_size % 8:
        raise UsageError(f"--page-size must be a multiple of 8, got {args.page_size}")
    for flag, value in (("--read-timeout", args.read_timeout), ("--max-body-mb", args.max_body_mb),
                        ("--kv-memory-gb", args.kv_memory_gb), ("--stored-seconds", args.stored_seconds),
                        ("--store-mb", args.store_mb)):
        if value is not None and not 0 < value < math.inf:
            raise UsageError(f"{flag} must be a number above 0, got {value}")
    parse_hosts(args.allowed_hosts)
    lora_flags.check_flags(args)
    check_draft_form(args)
    if head_folder(args) and speculate_steps(args) == 0:
        raise UsageError("--draft eagle3:DIR drafts on the device: --speculate-steps must be at least 1, got 0")
    if args.draft != "none" and args.draft_tokens >= args.prefill_chunk:
        raise UsageError(f"--draft-tokens must be less than --prefill-chunk ({args.prefill_chunk}), got "
                         f"{args.draft_tokens}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be at least 2, got {args.max_context}")


def max_context(args, config) -> int:
    """--max-context, checked against the model; by default the model's whole context (the KV cache is
    taken page by page as sequences grow, so a long limit sets no memory aside)."""
    if args.max_context is None:
        return config.max_context_length
    return inputs.max_context(args, config)


def parse_hosts(text: str | None) -> tuple[str, ...] | None:
    """--allowed-hosts as the names accepted (None: any, for `*` or when the flag is not given)."""
    if text is None:
        return None
    names = [name.strip().lower() for name in text.split(",")]
    if "*" in names:
        return None
    for name in names:
        if not name:
            raise UsageError(f"--allowed-hosts {text!r}: an empty name; give names separated by commas, or *")
        if name.count(":") == 1 or (name.startswith("[") and not name.endswith("]")):
            raise UsageError(f"--allowed-hosts: give names without their port, got {name!r}")
    return tuple(name.strip("[]") for name in names)


def is_loopback(host: str) -> bool:
    """Whether --host is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(args, loopback_names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The Host names the server accepts (None: any): --allowed-hosts, else `loopback_names` while it
    listens on loopback."""
    if args.allowed_hosts is None:
        return loopback_names if is_loopback(args.host) else None
    return parse_hosts(args.allowed_hosts)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn of at start-up: a server reachable beyond this machine that asks for no key."""
    if api_key or is_loopback(host):
        return None
    return (f"listening on {host}, beyond this machine, with no API key: whoever reaches the port can use the model "
            f"(pass --api-key KEY or set GPTOSS_API_KEY; /health and /metrics stay open without it)")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return run_command(lambda: build_parser(prog).parse_args(argv), _run, raising=True, program=argv is None)


def entry(prog: str | None = None) -> None:
    """The program's entry point (`gptoss-serve`, `python -m gptoss_jax.server`): main(), then exit
    (command.leave)."""
    leave(main(prog=prog or os.path.basename(sys.argv[0])))


def freeze_start_up_heap() -> None:
    """Take what start-up made (the model's pytrees, JAX, the tokenizer, compiled steps) out of the
    garbage collector's reach, once, when the server is ready. A full collection otherwise walks every
    one of those long-lived objects, with every thread stopped (0.24 s on a 2-core CPU machine, in a
    process that also holds torch and transformers), and every stream stalls that long. Objects made
    later are collected as before. vLLM's API server and engine do the same (gc.freeze after start-up)."""
    gc.collect()
    gc.freeze()


def _say(text: str) -> None:
    say(f"gptoss-serve: {text}")


def _stop_at_once() -> None:
    """Exit 0 now, without the interpreter's clean-up (as command.leave does for failures): stopped
    while the model loaded or the engine compiled, or while a scoring pass cut at the grace still
    runs, XLA still works on another thread, and tearing its runtime down under that work crashes
    the process (a segmentation fault, or an abort)."""
    _say("stopped")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_HINTS = {errno.EADDRINUSE: "another program listens there; stop it or choose another --port",
          errno.EADDRNOTAVAIL: "--host must be an address of this machine",
          errno.EACCES: "ports below 1024 need privileges; choose another --port"}


def _listen(host: str, port: int, api_key: str | None):
    """The listening socket, or None once the reason it cannot be had is said."""
    from .transport import bind

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock = bind(host, port)
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        hint = _HINTS.get(e.errno, "--host must be an address or a name of this machine")
        _say(f"error: cannot listen on {where} ({reason}): {hint}")
        return None
    if warning := exposure_warning(host, api_key):
        _say(f"warning: {warning}")
    return sock


def _run(args, signals: Signals) -> int:
    from .. import tokenizer as tk  # its constants only: the vocabulary is read once the port is taken

    check_flags(args)
    return_large_blocks()  # request bodies and stored responses of megabytes: their memory given back when freed
    processes = devices.process_settings(args)
    if processes is not None and args.draft != "none":
        raise UsageError("--draft runs on one process (a mesh of its devices), not with --num-processes")
    mesh_sizes = devices.mesh_sizes(args)
    config, what = model_config(args)
    check_head(args, config)
    max_len = max_context(args, config)
    if config.vocab_size != tk.VOCAB_SIZE:
        raise UsageError(f"this model's vocabulary has {config.vocab_size} tokens, not o200k_harmony's "
                         f"{tk.VOCAB_SIZE}: the OpenAI API needs the harmony tokenizer")
    api_key = args.api_key if args.api_key is not None else os.environ.get("GPTOSS_API_KEY") or None
    try:
        sock = None
        if processes is None or processes.get("process_id") == 0:  # process 0 listens (known here unless
            sock = _listen(args.host, args.port, api_key)             # --distributed: then once JAX starts)
            if sock is None:
                return 1
        return _serve(args, signals, sock, processes, mesh_sizes, config, what, max_len, api_key)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C while loading or compiling (serving, the server takes them)
        _stop_at_once()


def _serve(args, signals: Signals, sock, processes, mesh_sizes, config, what: str, max_len: int,
           api_key: str | None) -> int:
    from .. import tokenizer as tk

    vocab = tk.find_vocab(args.tokenizer)  # found once (downloaded if need be), not at every request
    tokenizer = tk.load_tokenizer(vocab)
    tk.harmony_encoding(vocab)  # checked now, not at the first request
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                                      else "gpt-oss-demo")

    # JAX starts here, once everything that can be checked without it has been.
    import jax

    from ..serving import Engine
    from ..drafts.eagle3 import Eagle3Draft
    from ..drafts.prompt_lookup import PromptLookup
    from ..serving.lockstep import LockstepError
    from ..sharding import describe
    from .app import create_app
    from .generation import LOOPBACK_HOSTS, Limits, Server
    from .transport import serve_forever

    devices.use_compile_cache(args.compile_cache)
    devices.start_processes(processes)
    mesh = devices.choose_mesh(mesh_sizes, config, dtype=loading.dtype_of(args))
    main_process = devices.quiet_other_processes()  # only process 0 listens and speaks
    if main_process and sock is None:
        sock = _listen(args.host, args.port, api_key)
        if sock is None:
            return 1
    args.quiet = args.quiet or not main_process
    unsplit = args.slots and devices.unsplit_batch(args.slots, mesh, f"--slots {args.slots}")  # (chosen: powers of 2)
    if main_process:
        if unsplit:
            _say(f"warning: {unsplit}")
        experts = "; experts packed in MXFP4" if loading.packed_experts(args) else ""
        _say(f"model: {what}{experts}; jax {jax.__version__}; {f'{args.slots} slots, ' if args.slots else ''}a context of {max_len:,} tokens")
        _say(f"devices: {describe(mesh, config) if mesh else '1 ' + jax.devices()[0].platform + ' device'}")
    read = lora_flags.read(args, config, name)  # (before the model loads: a folder we cannot serve ends it now)
    params, served = lora_flags.table(args, config, loading.load_params(args, config, mesh), read, name)
    draft = PromptLookup() if args.draft == "prompt-lookup" else None
    if head_folder(args) is not None:
        draft = Eagle3Draft.load(head_folder(args), config, params["embedding"].dtype)
        if main_process:
            _say(f"draft: the EAGLE-3 head in {head_folder(args)}, reading layers "
                 f"{', '.join(map(str, draft.config.aux_layers))}")
    engine = Engine(config, params, engine_options(args, max_len), tokenizer=tokenizer, draft=draft)
    lora_flags.put(engine, read, served, _say if main_process else None)
    if main_process:
        _say(kv_cache_line(engine))
    check_pool(engine, max_len)
    signals.check()  # a signal that came while a library swallowed its KeyboardInterrupt
    if not main_process:
        return _follow(engine, LockstepError)
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), read_timeout=args.read_timeout,
                    allowed_hosts=allowed_hosts(args, LOOPBACK_HOSTS), stored_responses=args.stored_responses,
                    stored_seconds=args.stored_seconds, stored_bytes=int(args.store_mb * 2**20))
    server = Server(engine, tokenizer, vocab, model_name=name, api_key=api_key, limits=limits, adapters=served)
    app = create_app(server)
    host = "[" + args.host + "]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}/v1"
    lock = threading.Lock()  # the warm-up's outcome against the server's end
    state = {"compiling": False, "running": False, "failed": False, "stopped": False}

    def warm_up(stop):
        try:
            compiled = engine.warm_up()
        except Exception as e:  # noqa: BLE001 — said, and the server stops with exit status 1
            with lock:
                state.update(compiling=False, failed=True)
            _say(f"error: warming up failed: {type(e).__name__}: {e}")
            stop()
            return
        with lock:
            state["compiling"] = False
            if state["stopped"]:
                return
            engine.start()
            state["running"] = True
        freeze_start_up_heap()
        server.ready.set()
        _say(f"compiled: {'; '.join(compiled)}")
        print(f"gptoss-serve: ready at {url} (model {name!r})", flush=True)

    def on_started(stop):  # listening, and SIGTERM and Ctrl-C are the server's from here
        state["compiling"] = True
        _say("compiling the engine's steps (the server answers 503 until they are ready)")
        threading.Thread(target=warm_up, args=(stop,), name="gptoss-warm-up", daemon=True).start()

    def stopping():
        server.stopping = True

    serve_forever(app, sock, grace=args.grace, on_started=on_started, on_exit=stopping, on_grace_over=server.cut_all,
                  header_timeout=args.read_timeout, max_connections=args.max_connections)
    with lock:
        state["stopped"] = True
        failed, compiling, running = state["failed"], state["compiling"], state["running"]
    server.stopping = True
    if failed:
        return 1  # its error line said why
    if compiling or server.workers.busy or server.scorer.busy:  # (a pass cut at the grace runs on)
        _stop_at_once()
    if running:
        engine.stop(cancel=True)
    _say("stopped")
    return 0


def _follow(engine, lost: type[Exception]) -> int:
    """A process other than 0: the same steps as process 0, until it stops. SIGINT and SIGTERM are
    left to process 0 (stopping here alone would hang the others' collectives)."""
    import jax

    engine.warm_up()
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
