"""asyncroll's layering, checked statically: no import circle among its modules, and no module
using another module's private names (``_name``); the floors talk through public verbs
(asyncroll.interfaces), as httpcore's pools talk to connections through its interfaces module.
Floor rules: ``asyncroll.vllm`` never reaches the trainer side, and only ``asyncroll/vllm/``
imports vLLM (``KNOWN_FLOOR_BREACHES`` lists today's exceptions, each awaiting a design change)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "asyncroll"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
VLLM_PRIVATES: dict[str, set[str]] = {
    # vLLM's worker LoRA manager has no public call that registers a LoRAModel built from
    # memory, nor one to answer its own reload of an evicted LoRA: these two privates of its
    # objects are vLLM's (our risk; run on 0.24 and 0.32: tests/test_lora.py).
    # A revision replayed into a LoRA slot registers vLLM's LoRAModel stand-in itself
    # (``_registered_adapters``), tells whether a LoRA is in a slot (``_active_adapters``), and
    # re-registers the real model before vLLM activates it again (``_add_adapter``); torch's
    # dispatch-mode op objects name their op and schema only privately.
    "asyncroll.vllm.lora": {
        "_adapter_manager", "_load_adapter", "_registered_adapters", "_active_adapters",
        "_add_adapter", "_overloadpacket", "_schema",
    },
    # Tests' probe of what a LoRA slot holds.
    "asyncroll.testing.probes": {"_adapter_manager"},
}
"""Privates of vLLM's own objects (reached through a parameter, not an imported name) that a
module of ``asyncroll/vllm/`` relies on, each with its reason."""

SHIMS: set[str] = set()
"""Old import paths kept for users that only re-export (none now: ``asyncroll.engine`` and
``asyncroll.vllm_ext`` went in session 28)."""


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
    allowed = VLLM_PRIVATES.get(name, set())
    foreign = [
        r for r in reached
        if r.split(".")[0] not in outside and r.rsplit(".", 1)[-1] not in allowed
    ]
    assert not taken, f"{name} imports private names: {taken}"
    assert not foreign or name in SHIMS, f"{name} reaches into other modules' privates: {foreign}"


TRAINER_SIDE = (
    "asyncroll.weights",
    "asyncroll.distributed",
    "asyncroll.trainer",
    "asyncroll.recipes",
)
"""The trainer's half: the update sequence, the pushers, the trainer, the recipes over them."""

KNOWN_FLOOR_BREACHES = {
    # The broadcast transport's NCCL group is vLLM's PyNcclCommunicator (an injected
    # communicator would let the transport stay below asyncroll.vllm).
    ("asyncroll.transport.broadcast", "vllm"),
}
"""Imports that break a floor rule below today, each waiting on a design change. The rules
fail on a breach not listed here, and on a listed one that is gone (then strike it here)."""


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _crossings(start: str, side: tuple[str, ...]) -> set[tuple[str, str]]:
    """The imports ``(importer, imported)`` by which ``start``, directly or through other
    asyncroll modules, reaches a module of ``side`` (type-checking imports count: they are
    design dependencies)."""
    seen, todo, found = {start}, [start], set()
    while todo:
        name = todo.pop()
        for other in _imports(name):
            if _within(other, side):
                found.add((name, other))
            elif other not in seen:
                seen.add(other)
                todo.append(other)
    return found


def _breaches_of_vllm_floor() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for name in MODULES:
        if _within(name, ("asyncroll.vllm",)):
            found |= _crossings(name, TRAINER_SIDE)
    return found


def _vllm_imports_outside_its_folder() -> set[tuple[str, str]]:
    found = set()
    for name, path in MODULES.items():
        if _within(name, ("asyncroll.vllm",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            if "vllm" in roots:
                found.add((name, "vllm"))
    return found


def test_the_vllm_adapter_never_imports_the_trainer_side() -> None:
    """``asyncroll.vllm`` and the trainer side stand side by side: the engine's half of an
    update never reaches (directly or through another module) the pushers, the trainer or
    the recipes; the manager composes them from above."""
    breaches = _breaches_of_vllm_floor()
    known = {b for b in KNOWN_FLOOR_BREACHES if b[1] != "vllm"}
    assert not breaches - known, f"asyncroll.vllm reaches the trainer side: {breaches - known}"
    assert not known - breaches, f"gone, strike from KNOWN_FLOOR_BREACHES: {known - breaches}"


def test_only_asyncroll_vllm_imports_vllm() -> None:
    """vLLM is one adapter among the engines: only ``asyncroll/vllm/`` imports it (inside
    functions too), so the manager, the transport and the trainer side run without it."""
    breaches = _vllm_imports_outside_its_folder()
    known = {b for b in KNOWN_FLOOR_BREACHES if b[1] == "vllm"}
    assert not breaches - known, f"vllm imported outside asyncroll/vllm/: {breaches - known}"
    assert not known - breaches, f"gone, strike from KNOWN_FLOOR_BREACHES: {known - breaches}"


def test_the_receive_core_stands_below_the_vllm_adapter() -> None:
    """``asyncroll.receive`` (a worker's load, check and rollback) imports torch and the
    transport: never the vLLM adapter, the trainer side or the manager, so it runs and is
    tested on a plain ``torch.nn.Module``; ``asyncroll.vllm.worker`` adapts vLLM onto it."""
    above = ("asyncroll.vllm", "asyncroll.manager", *TRAINER_SIDE)
    found: set[tuple[str, str]] = set()
    for name in MODULES:
        if _within(name, ("asyncroll.receive",)):
            found |= _crossings(name, above)
    assert not found, f"asyncroll.receive reaches above itself: {found}"

