"""The public namespace is exactly the sorted, explicit ``__all__`` (httpx's test, adapted)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import hookscope


def test_all_is_sorted_and_matches_public_names():
    assert hookscope.__all__ == sorted(hookscope.__all__)
    public = {n for n in dir(hookscope) if not n.startswith("_")}
    # submodules imported as a side effect of importing private modules are not API
    public -= {m.name for m in pkgutil.iter_modules(hookscope.__path__)} - {"ops"}
    assert public == set(hookscope.__all__) - {"__version__"}


def test_private_modules_have_explicit_all():
    for m in pkgutil.iter_modules(hookscope.__path__):
        mod = importlib.import_module(f"hookscope.{m.name}")
        if m.name.startswith("_cli") or m.name in {"__main__"}:
            continue
        assert hasattr(mod, "__all__"), f"hookscope.{m.name} has no __all__"


CORE = [
    "_select",
    "_scope",
    "_call",
    "_capture",
    "_edit",
    "_observe",
    "_extractor",
    "_trace",
    "_nested",
    "_inventory",
    "ops",
]


@pytest.mark.parametrize("name", CORE)
def test_docstring_examples_run(name):
    mod = importlib.import_module(f"hookscope.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
