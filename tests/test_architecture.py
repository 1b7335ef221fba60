"""The package is a one-way stack (docs/architecture.md, "Layers"): every import, at module level or
inside a function, goes to the importer's own layer or one below it, and no modules import each
other in a circle. The layer table is read from the doc itself, so the doc and the code cannot
drift apart. Each module also imports alone in a fresh interpreter, and none passes 500 lines.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "gptoss_jax"
DOC = os.path.join(ROOT, "docs", "architecture.md")
MAX_LINES = 500


def layers() -> list[tuple[str, list[str]]]:
    """(layer, module patterns) from the doc's table, bottom layer first."""
    text = open(DOC).read()
    table = re.search(r"<!-- layers:.*?-->\n(.*?)<!-- /layers -->", text, re.S)
    assert table, f"{DOC} has no layer table between <!-- layers --> markers"
    rows = [line.split("|")[1:-1] for line in table.group(1).strip().splitlines()[2:]]
    out = [(name.strip(), re.findall(r"`([^`]+)`", modules)) for name, modules, _ in rows]
    return out[::-1]


def modules(root: str) -> dict[str, str]:
    """Dotted name (relative to the package, "" for the package itself) -> file, for every module."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for folder, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), base)[:-3].replace(os.sep, ".")
                out[rel.removesuffix("__init__").rstrip(".")] = os.path.join(folder, f)
    return out


def imports(root: str) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of one of the package's modules by another,
    wherever it stands in the file."""
    mods = modules(root)
    edges = []
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = [PACKAGE] + (package.split(".") if package else [])
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
                targets = [t if t.removeprefix(PACKAGE + ".") in mods else base for t in targets]
            else:
                continue
            for target in targets:
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                rel = target.removeprefix(PACKAGE).lstrip(".")
                while rel not in mods:  # `import gptoss_jax.x.y` names module x.y; a name in x: module x
                    rel = rel.rpartition(".")[0]
                if rel != name:
                    edges.append((name, rel, node.lineno))
    return edges


def layer_of(name: str, table) -> int:
    """The index of `name`'s layer; "x.*" names every module of the folder x/, its __init__ too."""
    found = {i for i, (_, patterns) in enumerate(table) for p in patterns
             if fnmatch.fnmatchcase(name or PACKAGE, p) or (p.endswith(".*") and name == p[:-2])}
    assert len(found) == 1, f"module {name or PACKAGE!r} is in {len(found)} layers of {DOC}'s table, not one"
    return found.pop()


def upward(root: str, table) -> list[str]:
    """Every import from a lower layer to a higher one, as "a (layer) -> b (layer), line n"."""
    out = []
    for a, b, line in imports(root):
        la, lb = layer_of(a, table), layer_of(b, table)
        if lb > la:
            out.append(f"{a} ({table[la][0]}) imports {b} ({table[lb][0]}), line {line}")
    return out


def circles(root: str) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for a, b, _ in imports(root):
        graph[a].add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_sits_in_one_layer():
    table = layers()
    assert [name for name, _ in table] == ["primitives", "kernels", "model", "tree", "programs", "commands", "api"]
    for name in modules(ROOT):
        layer_of(name, table)


def test_no_import_goes_up_a_layer():
    assert upward(ROOT, layers()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(ROOT) == []


def test_a_planted_upward_import_and_circle_are_found(tmp_path):
    """The checks can fail: weight.py (a primitive) importing the model inside a function is both an
    upward import and a circle (model imports weight)."""
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE)
    with open(tmp_path / PACKAGE / "weight.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .model import Transformer\n\n    return Transformer\n")
    found = upward(str(tmp_path), layers())
    assert len(found) == 1 and found[0].startswith("weight (primitives) imports model (model)"), found
    (circle,) = circles(str(tmp_path))
    assert {"weight", "model"} <= set(circle), circle


def direct_kernel_imports(root: str) -> list[str]:
    """Every import of a kernel module (kernels.x) by a module outside the kernel layer."""
    return [f"{a} imports {b}, line {line}" for a, b, line in imports(root)
            if not (a == "kernels" or a.startswith("kernels.")) and b.startswith("kernels.")]


KERNEL_CHOOSERS = ("model/transformer.py", "model/attention.py", "model/moe.py")


def compared_kernel_names(root: str) -> list[str]:
    """Every comparison with a kernel variant's name ("auto" too) in the model's modules."""
    from gptoss_jax.kernels import ATTENTION, MOE

    names, out = set(ATTENTION) | set(MOE), []
    for f in KERNEL_CHOOSERS:
        path = os.path.join(root, PACKAGE, f)
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Compare):
                found = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names}
                out += [f"{f}, line {node.lineno}: {name!r}" for name in sorted(found)]
    return out


def test_the_model_reaches_kernels_only_through_the_kernel_layers_front():
    """Above the kernel layer, modules import `gptoss_jax.kernels` (Kernels and what it exports),
    never a kernel module, and the model's modules compare no kernel's name: the kernel layer owns
    its choices, so removing a variant is deleting its module and its registry entry."""
    assert direct_kernel_imports(ROOT) == []
    assert compared_kernel_names(ROOT) == []


def test_a_planted_kernel_import_and_name_are_found(tmp_path):
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE)
    with open(tmp_path / PACKAGE / "model" / "moe.py", "a") as f:
        f.write("\n\ndef _planted(kernels):\n    from ..kernels import tokamax\n\n"
                "    return tokamax if kernels.moe == 'grouped' else None\n")
    assert [x.split(",")[0] for x in direct_kernel_imports(str(tmp_path))] == ["model.moe imports kernels.tokamax"]
    assert [x.split(":")[1].strip() for x in compared_kernel_names(str(tmp_path))] == ["'grouped'"]


def test_no_module_passes_500_lines():
    long = {name: n for name, path in modules(ROOT).items() if (n := len(open(path).readlines())) > MAX_LINES}
    assert long == {}


# The libraries the package's modules import, imported once by the process the modules are imported
# from (the import of jax alone takes most of a second): none of them is the package's, so whatever
# one of its modules needs from another it still has to import itself.
# The libraries the package's modules import as they load (Pallas's Mosaic GPU alone takes a second or
# two): imported once before the forks, so that each child imports only the package's own modules.
LIBRARIES = ("numpy", "jax", "jax.numpy", "flax.linen", "optax", "ml_dtypes", "pydantic", "pydantic.json_schema",
             "fastapi", "fastapi.responses", "starlette", "starlette.routing", "prometheus_client",
             "prometheus_client.core", "jax.experimental.pallas", "jax.experimental.pallas.mosaic_gpu",
             "jax.experimental.pallas.triton", "jax.experimental.mosaic.gpu", "safetensors", "tiktoken")

# Imports each module named in argv[1] (comma-separated) in a child forked from a process that has
# imported the libraries in argv[2] and nothing of the package; prints those that failed, one line
# each: the module, then the last line of its error.
IMPORT_EACH = r"""
import importlib, os, sys, traceback
for name in sys.argv[2].split(","):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
assert not [m for m in sys.modules if m.split(".")[0] == "gptoss_jax"], "the package is imported already"
for full in sys.argv[1].split(","):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(full)
            status = 0
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            status = 1
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        error = f.read()
    if os.waitpid(pid, 0)[1]:
        print(full, "|", error, flush=True)
"""


def import_each(root: str, names: list[str]) -> list[str]:
    """The modules (dotted, relative to the package; "" the package) of the package under root that do
    not import alone: each in a process of its own that has imported nothing of the package."""
    full = [f"{PACKAGE}.{name}" if name else PACKAGE for name in names]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-c", IMPORT_EACH, ",".join(full), ",".join(LIBRARIES)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("batch", range(4))
def test_each_module_imports_alone(batch):
    """`import gptoss_jax.<module>` in a process that has imported nothing of the package (forked
    from one that has imported the libraries it uses), for every module (a quarter of them per test): no
    module depends on another having been imported first. A `__main__` module runs its program when
    imported, so it is left out."""
    names = [m for m in sorted(modules(ROOT)) if not m.endswith("__main__")][batch::4]
    assert import_each(ROOT, names) == []


@pytest.mark.slow
def test_a_module_that_needs_another_imported_first_is_caught(tmp_path):
    """The check above on a copy of the package with two modules planted that read `sampling.MODES`
    through the package: one imports gptoss_jax.sampling itself, the other only the package (which
    does not import it) and so works only after something else has. Named after `sampling` itself,
    the second still fails: each module's import starts from nothing of the package."""
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE)
    (tmp_path / PACKAGE / "_alone.py").write_text("import gptoss_jax.sampling\n\nMODES = gptoss_jax.sampling.MODES\n")
    (tmp_path / PACKAGE / "_after.py").write_text("import gptoss_jax\n\nMODES = gptoss_jax.sampling.MODES\n")
    assert import_each(str(tmp_path), ["sampling", "_alone", "_after"]) == [
        "gptoss_jax._after | AttributeError: module 'gptoss_jax' has no attribute 'sampling'"]


def test_the_public_names_resolve():
    """`gj.<name>` for every public name, wherever its module sits in the stack."""
    import gptoss_jax as gj

    missing = [name for name in gj.__all__ if getattr(gj, name, None) is None]
    assert missing == [] and {"init_params", "load_checkpoint", "param_shardings", "Weight"} <= set(gj.__all__)


# The decoding runtime and the engine: their contracts are typed (a config object, a plan, a
# protocol), never long argument lists or another module's private state.
RUNTIME = ("decoding.*", "drafts.*", "serving.*")
MOST_PARAMETERS = 8  # self and cls not counted


def long_signatures(root: str) -> list[str]:
    """Every function of the decoding runtime or the engine with more than MOST_PARAMETERS parameters."""
    out = []
    for name, path in modules(root).items():
        if not any(fnmatch.fnmatchcase(name, p) or name == p.removesuffix(".*") for p in RUNTIME):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
                names = names[1:] if names[:1] in (["self"], ["cls"]) else names
                if len(names) > MOST_PARAMETERS:
                    out.append(f"{name}.{node.name} takes {len(names)}, line {node.lineno}")
    return out


def engine_private_uses(root: str) -> list[str]:
    """Every use, outside serving/engine.py (in the package and bench/), of an attribute of `Engine`
    whose name starts with "_": an `engine._x` (or `self.engine._x`) where Engine defines `_x`."""
    tree = ast.parse(open(os.path.join(root, PACKAGE, "serving", "engine.py")).read())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    private = {n.name for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    private |= {t.attr for n in ast.walk(engine) for t in getattr(n, "targets", [getattr(n, "target", None)])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    private = {p for p in private if p.startswith("_") and not p.startswith("__")}
    paths = [p for n, p in modules(root).items() if n != "serving.engine"]
    paths += [os.path.join(root, "bench", f) for f in sorted(os.listdir(os.path.join(root, "bench"))) if f.endswith(".py")]
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and node.attr in private:
                holder = node.value
                named = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", "")
                if named in ("engine", "Engine"):
                    out.append(f"{os.path.relpath(path, root)}, line {node.lineno}: {named}.{node.attr}")
    return out


SAMPLING = "sampling"


def sampling_outside(root: str) -> list[str]:
    """Sampling defined outside sampling.py: a draw from `categorical`, or a function named sample*
    or filtered*."""
    out = []
    for name, path in modules(root).items():
        if name == SAMPLING:
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and node.attr == "categorical":
                out.append(f"{name}, line {node.lineno}: categorical")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.lstrip("_").startswith(
                    ("sample", "filtered")):
                out.append(f"{name}, line {node.lineno}: defines {node.name}")
    return out


def private_kernel_imports(root: str) -> list[str]:
    """Every kernel module importing a private name ("_x") of another kernel module."""
    out = []
    for a, path in modules(root).items():
        if not a.startswith("kernels"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                out += [f"{a} imports {node.module}.{x.name}, line {node.lineno}" for x in node.names
                        if x.name.startswith("_") and not x.name.startswith("__")]
    return out


FAMILIES = ("attention", "experts", "triton")  # kernels/'s folders, a family of variants each


def family_crossings(root: str) -> list[str]:
    """Every import of one kernel family's folder by a module of another (the registries, each
    family folder's __init__ of attention/ and experts/, name variants of every family: they are
    exempt), so that a family is removed with its folder and its registry rows."""
    out = []
    for a, b, line in imports(root):
        fa, fb = (x.split(".")[1] if x.startswith("kernels.") and x.count(".") >= 1 else None for x in (a, b))
        if fa in FAMILIES and fb in FAMILIES and fa != fb and a not in ("kernels.attention", "kernels.experts"):
            out.append(f"{a} imports {b}, line {line}")
    return out


def test_the_runtime_speaks_through_typed_contracts():
    """No function of the decoding runtime or the engine takes more than 8 parameters (a config object
    or a typed plan instead), no attribute of Engine that starts with "_" is used outside its own
    module, sampling is defined in one module, and no kernel module imports another's private name."""
    assert long_signatures(ROOT) == []
    assert engine_private_uses(ROOT) == []
    assert sampling_outside(ROOT) == []
    assert private_kernel_imports(ROOT) == []
    assert family_crossings(ROOT) == []


def test_planted_breaches_of_the_contracts_are_found(tmp_path):
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE)
    shutil.copytree(os.path.join(ROOT, "bench"), tmp_path / "bench")
    with open(tmp_path / PACKAGE / "serving" / "speculation.py", "a") as f:
        f.write("\n\ndef _planted(engine, a, b, c, d, e, f, g, h):\n    return engine._waiting\n")
    with open(tmp_path / PACKAGE / "decoding" / "acceptance.py", "a") as f:
        f.write("\n\ndef sample_greedy(logits):\n    return jax.random.categorical(None, logits)\n")
    with open(tmp_path / PACKAGE / "kernels" / "triton" / "decode_moe.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .common import _planted_private\n    from ..experts import xla\n")
    assert [x.split(",")[0] for x in long_signatures(str(tmp_path))] == ["serving.speculation._planted takes 9"]
    assert [x.split(":")[-1].strip() for x in engine_private_uses(str(tmp_path))] == ["engine._waiting"]
    assert [x.split(": ")[1] for x in sampling_outside(str(tmp_path))] == ["defines sample_greedy", "categorical"]
    assert [x.split(",")[0] for x in private_kernel_imports(str(tmp_path))] == [
        "kernels.triton.decode_moe imports common._planted_private"]
    assert [x.split(",")[0] for x in family_crossings(str(tmp_path))] == [
        "kernels.triton.decode_moe imports kernels.experts.xla"]
