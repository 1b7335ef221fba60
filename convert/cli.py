"""`python -m convert SOURCE_DIR OUTPUT_DIR`: the command line of the converter."""

from __future__ import annotations

import argparse
import signal
import sys

DESCRIPTION = """\
Convert a published GPT-OSS checkpoint into a gptoss-jax (Orbax) checkpoint.

SOURCE_DIR is one of:
  - the `original/` folder of openai/gpt-oss-20b or -120b (config.json + model.safetensors),
  - a Hugging Face checkpoint folder with MXFP4 experts (as published), or
  - a dequantized (bf16) Hugging Face checkpoint.
The layout is detected and printed. Every tensor is checked against config.json before anything is
written; OUTPUT_DIR appears only when the conversion is complete. Load the result with
`gptoss_jax.load_checkpoint(OUTPUT_DIR)` or `run_inference.py --checkpoint OUTPUT_DIR`.
"""


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SOURCE_DIR", help="folder with config.json and *.safetensors")
    parser.add_argument("output", metavar="OUTPUT_DIR", help="folder to create for the converted checkpoint")
    parser.add_argument("--dtype", choices=["mxfp4", "bfloat16", "float32"], default=None,
                        help="expert weights: mxfp4 keeps them packed as published and decodes them when "
                             "loaded (default for MXFP4 sources, ~13 GB for the 20b); bfloat16 or float32 "
                             "writes them decoded (float32 also stores every other weight in float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    def interrupt(signum, frame):  # a kill (SIGTERM) cleans up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)

    from .pipeline import ConversionError, check_output, plan_conversion, write_checkpoint

    try:
        check_output(args.output, args.overwrite, args.source)
        plan = plan_conversion(args.source, args.dtype)
        print(f"source: {plan.source} ({plan.layout} layout, {len(plan.tensors)} tensors, "
              f"{_format_bytes(plan.total_bytes)}); experts stored as {plan.storage}", file=sys.stderr)
        with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="converting",
                  disable=args.quiet, file=sys.stderr) as bar:
            summary = write_checkpoint(plan, args.output, overwrite=args.overwrite, progress=bar.update)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {args.output}: {summary.tensors} tensors, {_format_bytes(summary.bytes_read)} read, "
          f"{_format_bytes(summary.bytes_written)} written, {summary.seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
