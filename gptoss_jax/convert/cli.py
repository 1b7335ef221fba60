"""`gptoss-convert SOURCE_DIR OUTPUT_DIR` (also `python -m convert` in a checkout): the converter's command line."""

from __future__ import annotations

import argparse
import sys

from ..signals import Signals
from ..version import __version__

DESCRIPTION = """\
Convert a published GPT-OSS checkpoint into a gptoss-jax (Orbax) checkpoint.

SOURCE_DIR is one of:
  - the `original/` folder of openai/gpt-oss-20b or -120b (config.json + model.safetensors),
  - a Hugging Face checkpoint folder with MXFP4 experts (as published), or
  - a dequantized (bf16) Hugging Face checkpoint.
The layout is detected and printed. Every tensor is checked against config.json before anything is
written; OUTPUT_DIR appears only when the conversion is complete (its parent folders are created
where missing, and the command says so). Ctrl-C or SIGTERM before then leaves nothing (exit code 130
or 143). Load the result with `gptoss_jax.load_checkpoint(OUTPUT_DIR)` or
`run_inference.py --checkpoint OUTPUT_DIR`.
"""


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line: its exit code (conventions: gptoss_jax/cli/command.py).

    With argv None this is the program itself (the installed command, `python -m convert`), and
    Ctrl-C and SIGTERM stay taken until the process exits: put back, Python's own handlers would
    turn a signal in the last instant, after the output was renamed into place, into a traceback
    and exit 130 (or a kill, 143) with a complete output left behind. Called with argv, as from
    Python, the caller's handlers come back on return.
    """
    signals = Signals(raising=False)  # first of all: an early Ctrl-C must not print a traceback either
    try:
        return _main(argv, prog, signals)
    finally:
        if argv is not None:
            signals.restore()


def _main(argv, prog, signals) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SOURCE_DIR", help="folder with config.json and *.safetensors")
    parser.add_argument("output", metavar="OUTPUT_DIR", help="folder to create for the converted checkpoint")
    parser.add_argument("--dtype", choices=["mxfp4", "bfloat16", "float32"], default=None,
                        help="expert weights: mxfp4 keeps them packed as published, to be decoded when "
                             "loaded or kept packed on the device (run_inference.py --dtype mxfp4; default for "
                             "MXFP4 sources, ~13 GB for the 20b); bfloat16 or float32 "
                             "writes them decoded (float32 also stores every other weight in float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)

    # Start-up: the converter's libraries load once the flags parse (--help answers at once).
    from tqdm import tqdm

    from .pipeline import (ConversionError, Interrupted, OptionError, check_output, missing_folder, plan_conversion,
                           write_checkpoint)

    bar = None
    try:
        output = check_output(args.output, args.overwrite, args.source)
        plan = plan_conversion(args.source, args.dtype)
        if signals():
            raise Interrupted
        print(f"source: {plan.source} ({plan.layout} layout, {len(plan.tensors)} tensors, "
              f"{_format_bytes(plan.total_bytes)}); experts stored as {plan.storage}", file=sys.stderr)
        if (parent := missing_folder(output)) is not None:
            print(f"creating the missing folder {parent}", file=sys.stderr)
        bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="converting", disable=args.quiet,
                   file=sys.stderr)
        summary = write_checkpoint(plan, output, overwrite=args.overwrite, progress=bar.update,
                                   cancelled=signals)
        bar.close()
    except (ConversionError, Interrupted) as e:
        if bar is not None:
            bar.leave = False  # the error line replaces the bar
            bar.close()
        if isinstance(e, ConversionError):
            print(f"error: {e}", file=sys.stderr)
            return 2 if isinstance(e, OptionError) else 1
        print(f"error: {signals.what}; nothing was written", file=sys.stderr)
        return signals.exit_code
    print(f"wrote {args.output}: {summary.tensors} tensors, {_format_bytes(summary.bytes_read)} read, "
          f"{_format_bytes(summary.bytes_written)} written, {summary.seconds:.1f} s", file=sys.stderr)
    if signals():  # it came after the point of no return (write_checkpoint): the output is complete
        print(f"{signals.what} after the conversion had finished: {args.output} is complete and kept",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
