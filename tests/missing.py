"""What tests/run.sh would install, by name, that this Python lacks: one line each, none when all is there.

Usage: python tests/missing.py {torch,package,reference,mosaic}
  torch      torch 2.13.0 (any build)
  package    this checkout installed editable, and every requirement of pyproject.toml's dependencies
             and its `test` and `serve` extras, at a version the specifier allows
  reference  OpenAI's reference, gpt-oss 0.0.9
  mosaic     what the Mosaic GPU interpret-mode tests need (run by .venv-mosaic's Python): JAX 0.11.2,
             pytest, pytest-xdist, this checkout editable with its dependencies

Runs before anything is installed: the standard library and pip's own copy of `packaging` only.
"""
import importlib.metadata as metadata
import json
import os
import sys
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare Python: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"
REFERENCE = "gpt-oss==0.0.9"
MOSAIC = ["jax==0.11.2", "jaxlib==0.11.2", "pytest>=8", "pytest-xdist>=3.5"]  # tests/run.sh installs these


def _lacking(spec: str, extras: tuple[str, ...] = ("",)) -> str | None:
    """`spec` if no installed distribution satisfies it (or its marker rules it out: None)."""
    req = Requirement(spec)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
        return None
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return spec
    # torch's local version (2.13.0+cpu) satisfies ==2.13.0
    return None if req.specifier.contains(version.split("+")[0], prereleases=True) else f"{spec} (have {version})"


def _editable_here() -> bool:
    for dist in metadata.distributions():
        if (dist.metadata["Name"] or "").lower().replace("_", "-") != "gptoss-jax":
            continue
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("dir_info", {}).get("editable") and url.get("url") == f"file://{ROOT}":
            return True
    return False


def package(extras: tuple[str, ...] = ("test", "serve"), more: tuple[str, ...] = ()) -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    specs = project["dependencies"] + [s for e in extras for s in project["optional-dependencies"][e]] + list(more)
    out = [] if _editable_here() else [f"gptoss-jax (editable, from {ROOT})"]
    for spec in specs:
        if Requirement(spec).name == "gptoss-jax":
            continue  # the extra naming this package itself: its requirements are listed here too
        if (lacking := _lacking(spec, ("", *extras))) is not None:
            out.append(lacking)
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    lacking = {"torch": lambda: [s for s in [_lacking(TORCH)] if s], "package": package,
               "reference": lambda: [s for s in [_lacking(REFERENCE)] if s],
               "mosaic": lambda: package((), tuple(MOSAIC))}.get(what)
    if lacking is None:
        sys.exit(__doc__)
    for line in lacking():
        print(line)
