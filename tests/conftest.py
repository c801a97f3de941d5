"""Test-wide fixtures. The autouse fixture fails any test that leaves a hook on a module."""

from __future__ import annotations

import os
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as _module_mod

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Every nn.Module constructed in the test session, held weakly.
_LIVE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_orig_init = nn.Module.__init__


@torch._dynamo.disable
def _track(module: nn.Module) -> None:
    """Note a module (never compiled: a module a compiled forward builds, ``self.layers[:n]``,
    ran this under Dynamo, which traced the set's insertion and, depending on what the set held,
    failed with "already tracked for mutation")."""
    try:
        _LIVE.add(module)
    except TypeError:
        pass


def _tracking_init(self: nn.Module, *args, **kwargs) -> None:
    _orig_init(self, *args, **kwargs)
    if torch.compiler.is_compiling():
        return  # (a temporary module of a compiled forward: it holds no hook)
    _track(self)


nn.Module.__init__ = _tracking_init  # test-only instrumentation; the library never patches torch

_MODULE_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def leftover_hooks() -> list[str]:
    """Describe every hook still attached to a live module, parameter or globally."""
    found = []
    for mod in list(_LIVE):
        for attr in _MODULE_DICTS:
            d = getattr(mod, attr, None)
            if d:
                found += [f"{type(mod).__name__}.{attr}: {fn!r}" for fn in d.values()]
        for pname, p in getattr(mod, "_parameters", {}).items():
            if p is None:
                continue
            for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                d = getattr(p, attr, None)
                if d:
                    found += [f"{type(mod).__name__}.{pname}.{attr}: {fn!r}" for fn in d.values()]
    for attr in _GLOBAL_DICTS:
        d = getattr(_module_mod, attr, {})
        if d:
            found += [f"global {attr}: {fn!r}" for fn in d.values()]
    return found


@pytest.fixture(autouse=True)
def no_hooks_left_behind(request):
    """Fail any test that leaves a hook (hookscope's or its own) on a module or parameter."""
    before = set(leftover_hooks())
    yield
    if request.node.get_closest_marker("allow_leftover_hooks"):
        return
    after = [h for h in leftover_hooks() if h not in before]
    if after:
        # clean up so one failure does not cascade into every later test
        from hookscope import remove_hooks

        for mod in list(_LIVE):
            remove_hooks(mod)
        pytest.fail("test left hooks behind:\n  " + "\n  ".join(after[:20]), pytrace=False)


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0
