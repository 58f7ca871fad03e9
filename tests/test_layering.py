"""asyncroll's layering, checked statically: no import circle among its modules, and no module
using another module's private names (``_name``); the floors talk through public verbs
(asyncroll.interfaces), as httpcore's pools talk to connections through its interfaces module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "asyncroll"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
SHIMS = {"asyncroll.engine", "asyncroll.vllm_ext"}
"""Old import paths kept for users; they only re-export."""


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(name: str, *, typing: bool = True) -> dict[str, list[str]]:
    """asyncroll modules ``name`` imports (those under ``if TYPE_CHECKING`` too, unless
    ``typing`` is False), and the names it takes from each."""
    tree = ast.parse(MODULES[name].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not typing and _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    found.setdefault(alias.name, [])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    found.setdefault(sub, [])
                elif node.module in MODULES:
                    found.setdefault(node.module, []).append(alias.name)
    return found


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack, on_path, done = [(start, iter(sorted(graph[start])))], [start], set()
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.pop()
            done.add(node)
        elif child in on_path:
            return [*on_path[on_path.index(child):], child]
        elif child not in done:
            stack.append((child, iter(sorted(graph[child]))))
            on_path.append(child)
    return None


def test_no_import_circle() -> None:
    # A package's __init__ importing its own submodules is how packages re-export; a circle
    # is a module reaching back up to something that (transitively) imports it. Imports for
    # type checking count: a type-level circle is a design circle.
    graph = {
        name: {
            other
            for other in _imports(name)
            if other != name and not (name.endswith("__init__") or other.startswith(name + "."))
        }
        for name in MODULES
    }
    for name in MODULES:
        graph[name] = {o for o in graph[name] if not name.startswith(o + ".") or o not in MODULES}
    for name in MODULES:
        cycle = _cycle_from(name, graph)
        assert cycle is None, " -> ".join(cycle)


def _defined_here(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, attributes assigned anywhere."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _third_party_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0] for a in node.names
                if not a.name.startswith("asyncroll")
            }
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("asyncroll"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_uses_another_modules_private_names(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    own = _defined_here(tree)
    imported = _imports(name)
    taken = [f"{module}.{n}" for module, names in imported.items() for n in names if _private(n)]
    reached = sorted(
        {
            ast.unparse(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr not in own
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        }
    )
    outside = _third_party_names(tree)  # their privates are their business (and our risk)
    foreign = [r for r in reached if r.split(".")[0] not in outside]
    assert not taken, f"{name} imports private names: {taken}"
    assert not foreign or name in SHIMS, f"{name} reaches into other modules' privates: {foreign}"
