"""core is the engine every product shares, and nothing else.

Each core module is used by at least two packages above core (directly, or through the core
modules that use it), or holds a public verb named below. And core imports nothing but torch,
NumPy and the standard library (optional packages only through ``core/_optional.py``'s ``need``,
at run time); pyproject's import-linter contract says the same for the packages it lists.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import grimp
import pytest

CORE = Path(__file__).resolve().parents[2] / "src" / "hookscope" / "core"

# modules that hold a public verb (or the public ops), reached through `hookscope.<name>`
PUBLIC_VERBS = {
    "_blocks": "hs.blocks",
    "_capture": "hs.capture",
    "_edit": "hs.edit, hs.edit_grads, hs.clip_grads",
    "_inventory": "hs.hooks_on, hs.remove_hooks",
    "_observe": "hs.observe",
    "_ops": "hs.ops",
    "_trace": "hs.trace (and the command line's trace)",
}
# single-client modules on their way into their product (delete an entry when its move lands),
# and shared helpers whose clients adopt them in the same round
MOVING = {
    "_heads": "patching",
    "_prefix": "patching",
    "_rows": "patching",
    "_random": "shared: memory and extraction adopt random_draws/training_modules",
}
# the one third-party import allowed in core until core/_prefix.py moves into patching
THIRD_PARTY_ALLOWED = {("_prefix", "transformers")}


@functools.cache
def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("hookscope")


def _users(module: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
    """The packages above core that import ``module``, directly or through other core modules
    (the public namespaces ``hookscope`` and ``hookscope.core`` do not count)."""
    found: set[str] = set()
    for imp in _graph().find_modules_that_directly_import(module):
        if imp in ("hookscope", "hookscope.core", "hookscope.ops") or imp in seen:
            continue
        if imp.startswith("hookscope.core."):
            found |= _users(imp, seen | {module})
        else:
            found.add(imp.split(".")[1])
    return frozenset(found)


def _core_modules() -> list[str]:
    return sorted(p.stem for p in CORE.glob("_*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", _core_modules())
def test_each_core_module_is_shared_or_a_public_verb(name):
    if name in PUBLIC_VERBS or name in MOVING:
        return
    users = _users(f"hookscope.core.{name}")
    assert len(users) >= 2, (
        f"core/{name}.py is used by {sorted(users) or 'no package'}: code with one client "
        "belongs in that product (or name it in PUBLIC_VERBS if it is a public verb)"
    )


def test_the_allow_lists_name_existing_modules():
    present = set(_core_modules())
    assert set(PUBLIC_VERBS) <= present
    for name in set(MOVING) - present:  # moved: nothing to do, the entry may go
        assert name not in PUBLIC_VERBS


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return {t for t in tops if t not in sys.stdlib_module_names and t not in ("torch", "numpy")}


@pytest.mark.parametrize("name", _core_modules())
def test_core_imports_only_torch_numpy_and_the_standard_library(name):
    others = {t for t in _third_party(CORE / f"{name}.py") if (name, t) not in THIRD_PARTY_ALLOWED}
    assert not others, (
        f"core/{name}.py imports {sorted(others)}: core uses torch, NumPy and the standard library "
        "only; reach an optional package through core._optional.need() where it is used"
    )
