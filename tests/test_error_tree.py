"""The error tree drawn in ``asyncroll.errors``' docstring is the tree its classes form: every
exception class of the module is drawn once, under its parent, and every base outside the tree
is named on its line ("also a ValueError")."""

from __future__ import annotations

import inspect
import re

import asyncroll.errors as errors

ROOT = errors.AsyncrollError


def _drawing() -> list[tuple[int, str, str]]:
    """(depth, class name, the rest of the line) for each line of the docstring's drawing."""
    doc = errors.__doc__ or ""
    (block,) = re.findall(r"```\n(.*?)```", doc, flags=re.DOTALL)
    lines = []
    for line in block.splitlines():
        match = re.match(r"^((?:│   |    )*)(?:[├└]── )?(\w+)(.*)$", line)
        assert match, f"not a line of the drawing: {line!r}"
        prefix, name, rest = match.groups()
        depth = len(prefix) // 4 + (1 if "──" in line else 0)
        lines.append((depth, name, rest))
    return lines


def _drawn_parents() -> dict[str, str | None]:
    parents: dict[str, str | None] = {}
    path: list[str] = []
    for depth, name, _ in _drawing():
        del path[depth:]
        assert len(path) == depth, f"{name} is drawn deeper than the line above it allows"
        assert name not in parents, f"{name} is drawn twice"
        parents[name] = path[-1] if path else None
        path.append(name)
    return parents


def _classes() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, ROOT) and cls.__module__ == errors.__name__
    }


def test_the_drawing_shows_every_error_class_under_its_parent() -> None:
    drawn = _drawn_parents()
    actual = {
        name: next((base.__name__ for base in cls.__bases__ if issubclass(base, ROOT)), None)
        for name, cls in _classes().items()
    }
    assert sorted(set(actual) - set(drawn)) == [], "error classes missing from the drawing"
    assert sorted(set(drawn) - set(actual)) == [], "drawn names that are no error class"
    assert drawn == actual


def test_the_drawing_names_every_base_outside_the_tree() -> None:
    classes = _classes()
    for _, name, rest in _drawing():
        assert name in classes, f"{name} is drawn but is no error class of asyncroll.errors"
        others = [base.__name__ for base in classes[name].__bases__ if not issubclass(base, ROOT)]
        named = re.findall(r"also an? (\w+)", rest)
        assert named == [o for o in others if o != "Exception"], f"{name}: {rest.strip()!r}"


def test_every_error_of_the_module_is_exported() -> None:
    assert set(_classes()) <= set(errors.__all__)
