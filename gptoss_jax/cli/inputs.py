"""Everything the generation command line checks before a model is loaded (no JAX here).

Flags that do not fit together and a --max-context beyond the model's (usage errors, exit code 2),
and prompt files that are missing, empty, folders or binary (exit code 1), are refused at once with
one line naming the flag or file.
"""

from __future__ import annotations

import os
import sys

from ..config import ModelConfig
from ..metadata import expand, read_metadata


class UsageError(ValueError):
    """A flag or argument that cannot work (exit code 2); the message names it."""


class InputError(ValueError):
    """A file the command reads that is missing or unusable (exit code 1); the message names it."""


DEFAULT_MAX_CONTEXT = 4096


def read_text(path: str, flag: str) -> str:
    """A prompt file's text (`-` is standard input); one-line errors naming the flag and file."""
    if path == "-":
        return _decode(sys.stdin.buffer.read(), f"{flag} - (standard input)")
    path = expand(path)
    where = f"{flag} {path}"
    if os.path.isdir(path):
        raise InputError(f"{where}: is a folder, not a file")
    if not os.path.exists(path):
        raise InputError(f"{where}: no such file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"{where}: cannot read it ({e.strerror})") from None
    return _decode(data, where)


def _decode(data: bytes, where: str) -> str:
    if b"\0" in data:
        raise InputError(f"{where}: looks binary (it holds NUL bytes); a prompt file is UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: is not UTF-8 text (byte {e.start}); a prompt file is UTF-8 text") from None
    if not text.strip():
        raise InputError(f"{where}: is empty")
    return text


def prompt_texts(args) -> list[str] | None:
    """The prompt texts the flags give (None: none given, or token ids instead).

    `--chat` with no prompt flag reads the prompt from standard input when that is not a terminal
    (`echo "What is JAX?" | gptoss-generate --chat`), as chat command lines do when input is piped:
    on a terminal it holds a conversation instead, and off one the built-in demo prompt would answer
    a question nobody asked.
    """
    if args.batch_file is not None:
        texts = [line.rstrip("\r") for line in read_text(args.batch_file, "--batch-file").split("\n")]
        return [t for t in texts if t.strip()]
    if args.prompt_file is not None:
        return [read_text(args.prompt_file, "--prompt-file")]
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt: is empty")
        return [args.prompt]
    if args.chat and args.prompt_ids is None and not (sys.stdin is not None and sys.stdin.isatty()):
        data = sys.stdin.buffer.read() if sys.stdin is not None else b""
        if not data.strip():  # no terminal and nothing piped in: a script that forgot its prompt
            raise UsageError("--chat: no prompt given (--prompt, --prompt-file or --batch-file), and standard "
                             "input, not a terminal, is empty")
        return [_decode(data, "--chat: standard input")]
    return None


def check_flags(args, warn) -> None:
    """Flag combinations, before anything is read or loaded."""
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat needs text (--prompt, --prompt-file or --batch-file), not --prompt-ids")
    if not args.chat:
        if args.system is not None:
            warn("--system has no effect without --chat")
        if args.reasoning_effort is not None:
            warn("--reasoning-effort has no effect without --chat")
        if args.hide_reasoning:
            warn("--hide-reasoning has no effect without --chat")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_draft_form(args)
    if args.decode_steps < 1:
        raise UsageError(f"--decode-steps must be at least 1, got {args.decode_steps}")
    if args.draft_tokens < 1:
        raise UsageError(f"--draft-tokens must be at least 1, got {args.draft_tokens}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be at least 2, got {args.max_context}")


def model_config(args) -> tuple[ModelConfig, str]:
    """The model's config and a description, from the checkpoint's JSON alone (or the demo's)."""
    if args.checkpoint:
        config, _ = read_metadata(args.checkpoint)
        return config, f"checkpoint {expand(args.checkpoint)}"
    return ModelConfig.demo(), "built-in tiny demo model with RANDOM weights (its output is meaningless)"


def max_context(args, config: ModelConfig) -> int:
    """--max-context, checked against the model; by default min(4096, the model's context)."""
    if args.max_context is None:
        return min(DEFAULT_MAX_CONTEXT, config.max_context_length)
    if args.max_context > config.max_context_length:
        raise UsageError(f"--max-context {args.max_context} exceeds the model's context of "
                         f"{config.max_context_length} tokens")
    return args.max_context


DRAFT_CHOICES = "none, prompt-lookup or eagle3:DIR (the folder of an EAGLE-3 head)"


def draft_flag(value: str) -> str:
    """--draft's value (an argparse type): eagle3:DIR's folder with ~ expanded (`check_draft_form`
    checks the form, so that a wrong one is one line)."""
    return "eagle3:" + expand(value[len("eagle3:"):]) if value.startswith("eagle3:") and value != "eagle3:" else value


def head_folder(args) -> str | None:
    """The EAGLE-3 head's folder that --draft names, if it names one."""
    return args.draft[len("eagle3:"):] if args.draft.startswith("eagle3:") and args.draft != "eagle3:" else None


def check_draft_form(args) -> None:
    """--draft: none, prompt-lookup or eagle3:DIR."""
    if args.draft not in ("none", "prompt-lookup") and head_folder(args) is None:
        raise UsageError(f"--draft: choose {DRAFT_CHOICES}, not {args.draft!r}")


def check_head(args, config: ModelConfig) -> None:
    """--draft eagle3:DIR's head against the model, from its config.json alone."""
    folder = head_folder(args)
    if folder is None:
        return
    from ..sources import SourceError, read_config_json

    if not os.path.isdir(folder):
        raise UsageError(f"--draft eagle3:{folder}: no such folder")
    from ..eagle3_config import Eagle3Config

    try:
        head = Eagle3Config.from_json(read_config_json(folder), config.num_hidden_layers, f"{folder}/config.json")
    except (SourceError, ValueError, KeyError) as e:
        raise UsageError(f"--draft eagle3:{folder}: {e}") from None
    if head.vocab_size != config.vocab_size or head.target_hidden_size != config.hidden_size:
        raise UsageError(f"--draft eagle3:{folder}: a head for a model of vocabulary {head.vocab_size} and hidden "
                         f"size {head.target_hidden_size}, not {config.vocab_size} and {config.hidden_size}")


def check_draft(args, config: ModelConfig, max_len: int) -> None:
    """--draft's head against the model (`check_head`), and --draft-tokens: a step's drafted positions
    must not wrap the sliding ring."""
    check_head(args, config)
    ring = min(config.sliding_window, max_len)
    if args.draft != "none" and args.draft_tokens >= ring:
        raise UsageError(f"--draft-tokens must be less than {ring} for this model (its sliding window, or "
                         f"--max-context where smaller), got {args.draft_tokens}")


def check_fits(prompt_tokens: int, args, max_len: int) -> None:
    """The prompt plus --max-new-tokens must fit the KV cache (checked before the model loads)."""
    if prompt_tokens + args.max_new_tokens > max_len:
        raise UsageError(f"a prompt of {prompt_tokens} tokens plus --max-new-tokens {args.max_new_tokens} exceeds "
                         f"the max context of {max_len} (--max-context)")
