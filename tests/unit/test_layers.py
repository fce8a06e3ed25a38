"""The package layering of DESIGN.md ("Layers: one job each, arrows point down"), read from the
imports themselves (ast, no tool): a package imports only what its row allows, no module imports
its way back to itself, and none imports another module's private name (`_name`: what a module
keeps to itself, free to change; dunders are no secret). Imports inside functions count. Those
under `if TYPE_CHECKING:` never run, so the layer table leaves them out; a cycle counts them: two
modules that need each other are tangled whether or not the interpreter sees it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LEAVES = {"atomic", "errors", "faults", "phase", "pkgpath", "rewards", "scoring", "sizes"}
LAYER7 = {"config", "runs"} | LEAVES
LAYER6 = {"model", "precision"} | LAYER7
LAYER5 = {"parallel", "checkpoint", "data"} | LAYER6
# unit -> the units it may import (besides itself, `errors` and the package root).
ALLOWED = {
    "cli": {"commands"},
    "commands": {"train", "monitor", "diagnose"} | LAYER5,
    "train": {"monitor", "diagnose", "reward_pool"} | LAYER5,
    "reward_pool": {"scoring"},  # what a reward worker imports: no torch
    "monitor": LAYER5,
    "diagnose": {"monitor"} | LAYER5,
    "parallel": {"model", "precision"} | LAYER7,
    "checkpoint": LAYER7,
    "data": LAYER7,
    "model": LAYER7,
    "precision": LAYER7,
    "config": LAYER7 - {"runs"},
    "runs": LAYER7,
    **{leaf: set() for leaf in LEAVES},
}


def unit_of(module: str) -> str:
    """`trainbook.parallel.plan` -> "parallel"; `trainbook.__main__` -> "cli"; the root -> ""."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return "cli" if parts[1] == "__main__" else parts[1]


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `src` (a package's name is its __init__)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _source(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, relative imports resolved against `package`."""
    base = node.module or ""
    if node.level:  # relative: from the package up `level - 1` steps
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imports(module: str, path: Path, known: dict[str, Path], root: str, type_checking: bool = False) -> set[str]:
    """The trainbook modules `module` imports: `from a.b import c` is a.b.c when c is a module.
    Those under `if TYPE_CHECKING:` only with `type_checking`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_checking else _type_checking_only(tree)
    package = _package(module, path)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _source(node, package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if _ours(t, root))
    found.discard(module)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _ours(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def private_imports(module: str, path: Path, known: dict[str, Path], root: str) -> list[str]:
    """The private names `module` takes from other trainbook modules: `from a.b import _c`,
    `import a._b`, and `m._c` where `m` names an imported trainbook module (under
    `if TYPE_CHECKING:` too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _package(module, path)
    bound: dict[str, str] = {}  # local name -> the trainbook module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if _ours(a.name, root)):
                bound[a.asname or root] = a.name if a.asname else root
                if any(_private(part) for part in a.name.split(".")):
                    found.append((node.lineno, node.col_offset, a.name))
        elif isinstance(node, ast.ImportFrom) and _ours(base := _source(node, package), root):
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                if _private(a.name) and base != module:
                    found.append((node.lineno, node.col_offset, f"{base}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id]] + chain)
                if owner in known and owner != module:
                    found.append((node.lineno, node.col_offset, f"{owner}.{node.attr}"))
    return [f"{module} imports {name}, a private name of another module (line {line})"
            for line, _, name in sorted(found)]


def violations(src: Path, root: str = "trainbook") -> list[str]:
    known = modules(src)
    graph = {m: imports(m, p, known, root) for m, p in known.items()}
    typed = {m: imports(m, p, known, root, type_checking=True) for m, p in known.items()}
    problems = []
    for module, targets in sorted(graph.items()):
        mine = unit_of(module)
        for target in sorted(targets):
            theirs = unit_of(target)
            if theirs in ("", mine, "errors"):
                continue
            if theirs not in ALLOWED.get(mine, set()):
                problems.append(f"{module} imports {target}: {mine or 'the root'} may not import {theirs}")
    for module, path in sorted(known.items()):
        problems += private_imports(module, path, known, root)
    problems += [f"cycle: {' -> '.join(c)}" for c in cycles(typed)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (iterative DFS, Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group) + [sorted(group)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_package_follows_the_layer_table():
    found = violations(SRC)
    assert found == [], "\n".join(found)


def test_the_checker_sees_a_wrong_arrow_a_function_import_a_private_name_and_a_cycle(tmp_path):
    """The same checker on a small package that breaks each rule once (a private name in each
    way of taking it, a cycle in the open and one behind TYPE_CHECKING)."""
    pkg = tmp_path / "trainbook"
    for folder in ("parallel", "train", "data/tokenizer"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "parallel" / "launch.py").write_text("from trainbook.train.run import start\n")  # up
    (pkg / "train" / "run.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainbook.commands import x\n"
        "def f():\n    import trainbook.commands.run\n")  # in a function: counts
    (pkg / "data" / "tokenizer" / "__init__.py").write_text("from trainbook.data.tokenizer.hf import H\n")
    (pkg / "data" / "tokenizer" / "hf.py").write_text("from trainbook.data.tokenizer import backend\n")
    (pkg / "data" / "ok.py").write_text("from trainbook.errors import E\nfrom trainbook import __version__\n")
    (pkg / "data" / "secret.py").write_text("_KEY = 1\n\ndef _own():\n    return _KEY\n")
    (pkg / "data" / "peek.py").write_text(
        "from .secret import _KEY\nimport trainbook.data.secret\nimport trainbook.data.secret as s\n"
        "from trainbook.data import secret\nimport trainbook.data._hidden\n"
        "keys = (trainbook.data.secret._own, secret.__name__, s.public)\nmore = (s._own, secret._KEY)\n")
    (pkg / "train" / "loop.py").write_text("from trainbook.train.state import State\n")
    (pkg / "train" / "state.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainbook.train.loop import Loop\n")
    found = violations(tmp_path)
    assert found == [
        "trainbook.parallel.launch imports trainbook.train.run: parallel may not import train",
        "trainbook.train.run imports trainbook.commands.run: train may not import commands",
        "trainbook.data.peek imports trainbook.data.secret._KEY, a private name of another module (line 1)",
        "trainbook.data.peek imports trainbook.data._hidden, a private name of another module (line 5)",
        "trainbook.data.peek imports trainbook.data.secret._own, a private name of another module (line 6)",
        "trainbook.data.peek imports trainbook.data.secret._own, a private name of another module (line 7)",
        "trainbook.data.peek imports trainbook.data.secret._KEY, a private name of another module (line 7)",
        "cycle: trainbook.data.tokenizer -> trainbook.data.tokenizer.hf -> trainbook.data.tokenizer",
        "cycle: trainbook.train.loop -> trainbook.train.state -> trainbook.train.loop",
    ], found
