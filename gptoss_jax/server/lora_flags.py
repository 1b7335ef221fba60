"""gptoss-serve's LoRA flags: adapters served by name over the base model, unmerged (adapters.py).

    --lora NAME=PATH    an adapter folder (peft's format for GptOssForCausalLM, or gptoss-finetune's
                        --out) served under NAME; repeatable
    --max-loras N       entries of the table of served adapters (loaded now or later)
    --max-lora-rank R   the largest rank an entry holds
    --lora-targets G    the weights the table holds adapters for: attention, router, experts

The flags are checked before JAX starts; the folders are read once it has (before the model loads),
so a folder that cannot be served ends the command with one line naming the file and the field.
"""

from __future__ import annotations

from ..cli.inputs import UsageError

GROUPS = ("attention", "router", "experts")  # training/lora.TARGETS' groups (that module loads JAX)
DEFAULT_RANK, DEFAULT_TARGETS = 16, ("attention",)


def add_flags(p) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter under NAME, unmerged: requests whose \"model\" is NAME run under it, "
                        "others under the base model, rows of any adapters in one step. PATH: a peft adapter folder "
                        "for transformers' GptOssForCausalLM (adapter_config.json, adapter_model.safetensors) or "
                        "gptoss-finetune's --out; repeatable. More can be loaded while serving "
                        "(POST /v1/load_lora_adapter) up to --max-loras")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapters served at once, given with --lora or loaded later (default: the number of --lora)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help=f"the largest rank an adapter may have (default: the --lora adapters' largest, else "
                        f"{DEFAULT_RANK})")
    p.add_argument("--lora-targets", default=None, metavar="GROUPS",
                   help="comma-separated: the weights adapters may adapt: attention, router, experts (adapters on the "
                        "experts run the experts on the jnp paths, much slower on a GPU) (default: what the --lora "
                        f"adapters adapt, else {','.join(DEFAULT_TARGETS)})")


def check_flags(args) -> None:
    """UsageError for a malformed --lora, a repeated name, a bad count, rank or group."""
    loras = []
    for text in args.lora:
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UsageError(f"--lora {text!r}: give NAME=PATH (the name requests send as \"model\", the adapter's "
                             "folder)")
        if name in [n for n, _ in loras]:
            raise UsageError(f"--lora: the name {name!r} is given twice")
        loras.append((name, path))
    args.lora = loras
    if args.max_loras is not None and args.max_loras < len(loras):
        raise UsageError(f"--max-loras must be at least the number of --lora ({len(loras)}), got {args.max_loras}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise UsageError(f"--max-lora-rank must be at least 1, got {args.max_lora_rank}")
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        bad = [t for t in targets if t not in GROUPS]
        if bad or not targets:
            raise UsageError(f"--lora-targets: {', '.join(bad) or 'none given'}; choose from {', '.join(GROUPS)}")
        args.lora_targets = targets


def read(args, config, base: str) -> list:
    """The --lora adapters read, [(name, training.adapter_files.Adapter)]: UsageError naming the flag,
    the file and the field (JAX has started; the model has not loaded yet)."""
    from ..training.adapter_files import AdapterError, read_adapter  # (JAX's modules: once the flags are checked)

    out = []
    for name, path in args.lora:
        if name == base:
            raise UsageError(f"--lora {name}={path}: {name!r} is the base model's name (--served-model-name)")
        try:
            adapter = read_adapter(path, config, max_rank=args.max_lora_rank)
        except AdapterError as e:
            raise UsageError(f"--lora {name}={path}: {e}") from None
        if args.lora_targets is not None and not set(adapter.targets) <= set(args.lora_targets):
            raise UsageError(f"--lora {name}: the adapter adapts {', '.join(adapter.targets)}, beyond --lora-targets "
                             f"{','.join(args.lora_targets)}")
        out.append((name, adapter))
    return out


def table(args, config, params, read: list, base: str):
    """-> (params with the table of served adapters, or as given without one; adapters.ServedAdapters):
    --max-loras entries, of --max-lora-rank, on --lora-targets, their defaults from the adapters `read`."""
    from ..training.lora import empty_table  # (as in `read`)
    from .adapters import ServedAdapters

    entries = len(read) if args.max_loras is None else args.max_loras
    rank = args.max_lora_rank or max((a.rank for _, a in read), default=DEFAULT_RANK)
    held = {t for _, a in read for t in a.targets}
    targets = args.lora_targets or tuple(g for g in GROUPS if g in held) or DEFAULT_TARGETS  # (read checked them)
    if entries:
        params = empty_table(config, params, entries, rank, targets)
    return params, ServedAdapters(base, entries, rank, targets)


def put(engine, read: list, served, say=None) -> None:
    """The adapters read at start put into the first entries, under their names; `say`: the start-up's
    line (where adapters are served)."""
    import time

    from .adapters import Named

    for entry, (name, adapter) in enumerate(read):
        engine.put_adapter(entry, adapter.weights)
        served.names[name] = Named(entry, adapter.path, int(time.time()))
    if say is not None and served.entries:
        say(f"LoRA adapters: {', '.join(served.serving()) or 'none yet'}; up to {served.entries} at once, of rank "
            f"up to {served.max_rank}, on {', '.join(served.targets)}")
