"""The import graph runs one way: data <- models <- inference <- train <- tools.

Every project module's imports are read with `ast` (none is executed). The rule, stated once:

* A module's layer is its package's (`LAYERS`), except the entry points listed in `TOOLS` (a module, or a package
  and everything in it) and everything in `scripts/`, which are the top layer: command lines, benchmarks, the tree
  builder. A module may import its own layer or a lower one, never a higher one, so nothing below a tool imports it.
  The collectors (inference.collect) are inference-layer modules: a training run self-distils in-run.
* Inside inference the groups are layered the same way (`INFERENCE_GROUPS`): kernels <- engine <- drafters <- api
  (the package's public face: inference itself, api, options, textstream, session) <- collect, bench <- cli. A module
  imports its own group or a lower-ranked one; collect and bench share a rank and do not import each other.
* Module-level imports form no cycle (function-local imports do not dodge this: they are in the graph too, below).
* A module's `if __name__ == "__main__":` block is a command line: it runs only when the module is the program, so
  it counts as a tool (`scripts/collect_jacobi.py` runs the collector in inference/ that way).
* A function-local import of a project module is allowed only when it defers something heavy or optional on purpose,
  and says so on its line: `# deferred: <reason>`. Imports under `if TYPE_CHECKING:` are typing only and exempt
  from that rule, not from the next one.
* Across the whole tree, every import counted (typing-only ones and `__main__` blocks too), there is no cycle and no
  upward edge: a module that needs a type from above takes a Protocol, and a program's hand-over to a tool sits in
  the tool, so reading any module never leads back to itself.

`python tests/test_layering.py` prints the figures (cycles, upward edges, function-local imports).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("conf", "data", "models", "inference", "train")
LAYERS = {"conf": 0, "data": 0, "models": 1, "inference": 2, "train": 3}
TOOL_LAYER = 4
# Entry points inside the packages: they sit above every package (see the module docstring).
TOOLS = frozenset({
    "inference.__main__", "inference.cli", "inference.session", "inference.bench",  # inference.bench: the package
    "train.__main__", "train.cli",
})
# inference's groups (a subpackage, or named top-level modules) and their ranks: lower ranks never import higher.
INFERENCE_GROUPS = {
    "kernels": (0, ("inference.kernels",)),
    "engine": (1, ("inference.engine",)),
    "drafters": (2, ("inference.drafters",)),
    "api": (3, ("inference", "inference.api", "inference.options", "inference.textstream", "inference.session")),
    "collect": (4, ("inference.collect",)),
    "bench": (4, ("inference.bench",)),
    "cli": (5, ("inference.cli", "inference.__main__")),
}
DEFERRED = "# deferred:"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module (the deepest one that exists)
    line: int
    local: bool  # inside a function body
    justified: bool  # the line carries "# deferred: <reason>"
    main: bool = False  # under `if __name__ == "__main__":` (runs only as a program: a tool's import)
    typing: bool = False  # under `if TYPE_CHECKING:` (never runs: a type annotation's import)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every project module (packages and scripts/)."""
    files = {}
    for package in (*PACKAGES, "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _within(module: str, prefix: str) -> bool:
    """`module` is `prefix` or inside it (the package `inference` names only its own __init__ here)."""
    return module == prefix or (module.startswith(prefix + ".") and prefix != "inference")


def layer(module: str) -> int:
    top = module.split(".")[0]
    if top == "scripts" or any(_within(module, t) for t in TOOLS):
        return TOOL_LAYER
    return LAYERS[top]


def group(module: str) -> str | None:
    """The inference group a module belongs to (None outside inference, or in none: a test fails on that)."""
    for name, (_, members) in INFERENCE_GROUPS.items():
        if any(_within(module, m) for m in members):
            return name
    return None


def group_edges(edges: list[Import]) -> list[Import]:
    """The imports from one inference group into another."""
    return [e for e in edges if group(e.source) is not None and group(e.target) is not None
            and group(e.source) != group(e.target)]


def upward_in_inference(edges: list[Import]) -> list[Import]:
    """Imports between inference's groups that do not go to a lower rank (a `__main__` block counts as the CLI)."""
    rank = {name: r for name, (r, _) in INFERENCE_GROUPS.items()}
    return [e for e in group_edges(edges)
            if rank[group(e.target)] >= (rank["cli"] + 1 if e.main else rank[group(e.source)])]


def _resolve(name: str, known: set[str]) -> str | None:
    """The deepest known module that `name` (a module or module.attribute) names."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_main_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, main: bool = False, typing: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, local, main, True)
                continue
            if isinstance(child, ast.If) and _is_main_block(child) and not local:
                visit(child, local, True, typing)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, main, typing)
                continue
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" for a in child.names] or [base]
            else:
                visit(child, local, main, typing)
                continue
            justified = DEFERRED in lines[child.lineno - 1]
            targets = {_resolve(name, known) for name in names} - {None, module}
            found.extend(Import(module, t, child.lineno, local, justified, main, typing) for t in sorted(targets))

    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    files = module_files()
    known = set(files)
    return [imp for module, path in files.items() for imp in imports_of(module, path, known)]


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def upward(edges: list[Import]) -> list[Import]:
    return [e for e in edges if layer(e.target) > (TOOL_LAYER if e.main else layer(e.source))]


def import_time(edges: list[Import]) -> list[Import]:
    """The edges that run when a module is imported: a `__main__` block's run only when it is the program, a
    `TYPE_CHECKING` block's never."""
    return [e for e in edges if not e.main and not e.typing]


def whole_tree_upward(edges: list[Import]) -> list[Import]:
    """Every edge to a higher layer, a `__main__` block's and a typing-only one's too (in place of `upward`'s
    allowance for programs)."""
    return [e for e in edges if layer(e.target) > layer(e.source)]


def _show(e: Import) -> str:
    return f"{e.source}:{e.line} -> {e.target}"


def test_module_level_imports_have_no_cycle() -> None:
    module_level = [e for e in import_time(all_imports()) if not e.local]
    assert cycles(module_level) == []


def test_all_imports_have_no_cycle() -> None:
    """Function-local imports included: deferring an import must not be a way to close a cycle."""
    assert cycles(import_time(all_imports())) == []


def test_no_upward_import() -> None:
    assert [_show(e) for e in upward([e for e in all_imports() if not e.typing])] == []


def test_whole_tree_has_no_cycle() -> None:
    """Every import counted, typing-only and `__main__` blocks too: no module leads back to itself."""
    assert cycles(all_imports()) == []


def test_whole_tree_has_no_upward_edge() -> None:
    """Every import counted: nothing below a layer names it, not even for a type or a program's hand-over."""
    assert [_show(e) for e in whole_tree_upward(all_imports())] == []


def test_every_inference_module_has_a_group() -> None:
    assert [m for m in module_files() if m.startswith("inference") and group(m) is None] == []


def test_inference_groups_import_one_way() -> None:
    """kernels <- engine <- drafters <- api <- collect, bench <- cli: no group imports a higher or equal-ranked one."""
    assert [_show(e) for e in upward_in_inference(all_imports())] == []


def group_map() -> str:
    """inference's groups in rank order: files with their line counts, and the groups each imports."""
    files = module_files()
    edges = group_edges(import_time(all_imports()))
    out = []
    for name, (rank, _) in sorted(INFERENCE_GROUPS.items(), key=lambda kv: kv[1][0]):
        members = {m: files[m] for m in files if group(m) == name}
        lines = {m: len(p.read_text().splitlines()) for m, p in members.items()}
        deps = sorted({group(e.target) for e in edges if group(e.source) == name})
        out.append(f"{rank} {name}: {len(members)} modules, {sum(lines.values())} lines; imports {deps or 'nothing'}")
        out.append("    " + ", ".join(f"{files[m].relative_to(ROOT / 'inference')} {n}" for m, n in lines.items()))
    return "\n".join(out)


def test_function_local_project_imports_are_justified() -> None:
    unjustified = [_show(e) for e in all_imports() if e.local and not e.justified]
    assert unjustified == []


def training_steps(source: str) -> list[int]:
    """Lines that train something: an optimizer built from `torch.optim` or a `.backward()` call."""
    steps = []
    for node in ast.walk(ast.parse(source)):
        optimizer = (isinstance(node, ast.Attribute) and node.attr == "optim" and isinstance(node.value, ast.Name)
                     and node.value.id == "torch")
        backward = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "backward")
        if optimizer or backward:
            steps.append(node.lineno)
    return sorted(set(steps))


def test_training_lives_in_train() -> None:
    """Below train/ nothing trains: the built-in tiny models' builder is train.tiny_build, and models/ only locates
    what it built (models.tiny). The reader is not vacuous: it finds both kinds of step in a planted snippet."""
    assert training_steps("import torch\nopt = torch.optim.AdamW(ps)\nloss.backward()\n") == [2, 3]
    below_train = {m: p for m, p in module_files().items() if layer(m) < LAYERS["train"]}
    assert {m: lines for m, p in below_train.items() if (lines := training_steps(p.read_text()))} == {}


def test_rule_sees_a_planted_upward_import(tmp_path: Path) -> None:
    """The reader is not vacuous: an upward and a cyclic import written into a file are both found."""
    path = tmp_path / "planted.py"
    path.write_text("import models.loading\n\ndef f():\n    from train.cli import main\n\n"
                    "if __name__ == \"__main__\":\n    from inference.cli import main\n")
    known = set(module_files())
    found = imports_of("data.planted", path, known | {"data.planted"})
    assert [(e.target, e.local, e.justified, e.main) for e in found] == [
        ("models.loading", False, False, False), ("train.cli", True, False, False), ("inference.cli", False, False, True)]
    assert [e.target for e in upward(found)] == ["models.loading", "train.cli"]  # a __main__ block is a tool
    assert [e.target for e in import_time(found)] == ["models.loading", "train.cli"]
    inside = [Import("inference.engine.loop", "inference.drafters.medusa", 1, False, False),  # up a rank
              Import("inference.bench.run", "inference.collect.self_distill", 1, True, True),  # same rank
              Import("inference.cli", "inference.bench.run", 1, False, False)]  # down: fine
    assert [e.target for e in upward_in_inference(inside)] == ["inference.drafters.medusa", "inference.collect.self_distill"]
    loop = [Import("a", "b", 1, False, False), Import("b", "c", 1, False, False), Import("c", "a", 1, False, False)]
    assert cycles(loop) == [["a", "b", "c"]]



def test_whole_tree_rule_sees_typing_and_main_imports(tmp_path: Path) -> None:
    """A typing-only import and a `__main__` block's are found, left out of what runs at import time, and counted by
    the whole-tree rules (the early_exit <-> refs and data.jacobi <-> collector circles were such edges)."""
    path = tmp_path / "planted.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from inference.api import Engine\n\n"
                    "if __name__ == \"__main__\":\n    from train.cli import main\n")
    found = imports_of("models.planted", path, set(module_files()) | {"models.planted"})
    assert [(e.target, e.typing, e.main) for e in found] == [("inference.api", True, False), ("train.cli", False, True)]
    assert import_time(found) == [] and upward([e for e in found if not e.typing]) == []
    assert [e.target for e in whole_tree_upward(found)] == ["inference.api", "train.cli"]
    back = [Import("inference.api", "models.planted", 1, False, False)]
    assert cycles(found + back) == [["inference.api", "models.planted"]]

if __name__ == "__main__":
    edges = all_imports()
    local = [e for e in edges if e.local]
    print(f"modules: {len(module_files())}, project import edges: {len(edges)}")
    print(f"cycles among module-level imports: {cycles([e for e in import_time(edges) if not e.local])}")
    print(f"cycles with function-local imports: {cycles(import_time(edges))}")
    print(f"cycles with every import (typing-only, __main__ blocks): {cycles(edges)}")
    print(f"upward edges with every import: {len(whole_tree_upward(edges))}")
    for e in whole_tree_upward(edges):
        print("  ", _show(e), "(__main__)" if e.main else "(typing)" if e.typing else "")
    ups = upward([e for e in edges if not e.typing])
    print(f"upward edges: {len(ups)}")
    for e in ups:
        print("  ", _show(e), "(local)" if e.local else "")
    ups = upward_in_inference(edges)
    print(f"upward edges between inference's groups: {len(ups)}")
    for e in ups:
        print("  ", _show(e), "(local)" if e.local else "")
    print(group_map())
    statements = {(e.source, e.line) for e in local}
    print(f"function-local project imports: {len(local)} edges in {len(statements)} statements "
          f"(justified: {sum(e.justified for e in local)})")
    for e in local:
        print("  ", _show(e), "ok" if e.justified else "")
