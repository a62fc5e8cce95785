"""The package's layers, read from its imports: nothing imports a layer above its own, and
no modules import each other in a cycle.

    backend/ (compiled core)  <  the Python core  <  torch/  <  `fastreduce`  <  tools/

Read from the source tree (Python with ast, Cython with its import lines), every import
counted, including those inside functions. The public names of the modules in torch/ and
tools/ (fastreduce.nn, fastreduce.bench, ...) are `fastreduce/__init__.py`'s table, which
`import` reads through a finder; each has a file beside `__init__.py` for type checkers (a
re-export of the module it names, never run), in the `fastreduce` layer.
"""

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "fastreduce"
PUBLIC_NAMES = ("autograd", "bench", "cluster", "distdl", "distributed", "gradsync", "horovod",
                "info", "nn", "ops")  # checked against the table below
LAYERS = ("backend", "core", "torch", "public", "tools")
CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+c?import\s+([\w., ()*]+)|"
                           r"c?import\s+([\w.]+))", re.M)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    name = module.removeprefix("fastreduce.")
    if module == "fastreduce" or (name in PUBLIC_NAMES and not tools_name(name)):
        return "public"
    if name in PUBLIC_NAMES:  # a tool's public name sits with the tools
        return "tools"
    for sub in ("backend", "torch", "tools"):
        if module.startswith(f"fastreduce.{sub}.") or module == f"fastreduce.{sub}":
            return sub
    return "core"


def resolve(module: str, is_package: bool, level: int, name: str) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def known(target: str, modules: set[str]) -> str | None:
    """The fastreduce module an import refers to (a module, or the package of a name)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The fastreduce modules that the file at path imports."""
    return imports_in(path.read_text(), path.suffix, module_name(path),
                      path.stem == "__init__", modules)


def imports_in(text: str, suffix: str, module: str, is_package: bool,
               modules: set[str]) -> set[str]:
    """The fastreduce modules that source text of `module` imports."""
    found: set[str] = set()

    def add(base: str, names: list[str]) -> None:
        for name in names or [""]:
            target = known(f"{base}.{name}" if name else base, modules)
            if target and target != module:
                found.add(target)

    if suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, [])
            elif isinstance(node, ast.ImportFrom):
                add(resolve(module, is_package, node.level, node.module or ""),
                    [a.name for a in node.names])
    else:
        for frm, names, plain in CYTHON_IMPORT.findall(text):
            if plain:
                add(plain, [])
                continue
            level = len(frm) - len(frm.lstrip("."))
            listed = [n.strip().split(" as ")[0] for n in names.strip("()").split(",")]
            add(resolve(module, is_package, level, frm.lstrip(".")), listed)
    return {m for m in found if m.startswith("fastreduce")}


def graph() -> dict[str, set[str]]:
    files = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".pyx", ".pxd", ".pxi")]
    modules = {module_name(p) for p in files}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        edges[module_name(path)] |= imports_of(path, modules)
    return edges


def test_the_layers_are_the_tree():
    """Every module sits in one of the layers, and each layer has modules."""
    seen = {layer(m) for m in graph()}
    assert seen == set(LAYERS), seen


def test_no_import_reaches_a_layer_above():
    edges = graph()
    upward = sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})"
                    for m, targets in edges.items() for t in targets
                    if LAYERS.index(layer(t)) > LAYERS.index(layer(m)))
    assert not upward, "\n".join(upward)


def tools_name(name: str) -> bool:
    """Whether public name `name` names a module of tools/."""
    return public_modules()[name].startswith("tools.")


@functools.cache
def public_modules() -> dict[str, str]:
    """fastreduce/__init__.py's table: public name -> real module (relative), read statically."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_PUBLIC_MODULES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("fastreduce/__init__.py has no _PUBLIC_MODULES table")


def test_public_names_are_the_table():
    """Each public name names a module of torch/ or tools/, and its file is a re-export of
    that module and nothing else (a docstring, one `from .<real> import *`): the finder
    serves the real module at run time, and the file is what type checkers read."""
    modules = set(graph())
    table = public_modules()
    assert table, "the table is empty"
    assert set(PUBLIC_NAMES) == set(table), (sorted(PUBLIC_NAMES), sorted(table))
    for public, real in table.items():
        assert f"fastreduce.{real}" in modules, f"fastreduce.{public}: no module {real}"
        assert layer(f"fastreduce.{real}") in ("torch", "tools"), (public, real)
        body = ast.parse((PACKAGE / f"{public}.py").read_text()).body
        assert len(body) == 2 and ast.get_docstring(ast.Module(body, [])), (
            f"{public}.py holds more than its docstring and the re-export")
        star = body[1]
        assert isinstance(star, ast.ImportFrom) and star.level == 1 and \
            star.module == real and [a.name for a in star.names] == ["*"], (
                f"{public}.py does not re-export .{real}")
    assert not list(PACKAGE.glob("*.pyi")), "a stub beside a public name's file"


def test_only_gpupaths_talks_to_the_path_choice():
    """The Python core reaches the compiled GPU path choice (backend.pathchoice) only
    through fastreduce.gpupaths."""
    edges = graph()
    callers = sorted(m for m, targets in edges.items()
                     if "fastreduce.backend.pathchoice" in targets and layer(m) != "backend"
                     and not m.startswith("fastreduce.gpupaths"))
    assert not callers, callers


def test_the_horovod_matching_needs_no_mpi():
    """torch/horovod/matching (what a round of the matching by name decides) imports
    neither MPI nor torch, and of fastreduce only its exceptions: it is tested without a
    job (test_horovod_matching.py loads it without the package)."""
    path = PACKAGE / "torch" / "horovod" / "matching.py"
    tree = ast.parse(path.read_text())
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    found |= {resolve(module_name(path), False, node.level, node.module or "")
              for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in found if m.split(".")[0] in ("mpi4py", "torch")}, found
    assert {m for m in found if m.startswith("fastreduce")} == {"fastreduce.errors"}, found


def test_no_import_cycles():
    edges = graph()
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


MODULES = {"fastreduce", "fastreduce.checks", "fastreduce.gpupaths", "fastreduce.backend",
           "fastreduce.backend.buffer", "fastreduce.backend.collectives"}


@pytest.mark.parametrize("suffix, source, expected", [
    (".pyx", "from ..checks import fingerprint\n", {"fastreduce.checks"}),
    (".pyx", "    from .. import gpupaths\n", {"fastreduce.gpupaths"}),
    (".pyx", "from .buffer cimport BufferView\n", {"fastreduce.backend.buffer"}),
    (".py", "def f():\n    import fastreduce.gpupaths\n", {"fastreduce.gpupaths"}),
    (".py", "from .. import checks as c\n", {"fastreduce.checks"}),
])
def test_the_reader_sees_every_import(suffix, source, expected):
    """The import reader finds imports in both languages, inside functions too (so the
    checks above can fail)."""
    found = imports_in(source, suffix, "fastreduce.backend.collectives", False, MODULES)
    assert found == expected
