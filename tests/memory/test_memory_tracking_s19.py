"""Audit s19: ``memory_profile`` when the profiled step changes the modules its hooks sit on: a
forward that rebuilds a sub-layer (``self.fc = nn.Linear(...)`` for the input's width), builds
one on its first call, or calls ``hs.remove_hooks``. Before, the new module ran unhooked without a
word: its row said 0 calls and 0 bytes while its saved bytes and FLOPs were charged to its parent.
Each test checks the warning's content (the layer, what the model holds there now, where its bytes
went, the fix), and the normal path against bytes counted by hand.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn as nn

import hookscope as hs

F32 = 4


class Rebuilds(nn.Module):
    """Rebuilds ``fc`` for the width of its input (a replacement during the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc.in_features != x.shape[-1]:
            self.fc = nn.Linear(x.shape[-1], 4)
        return torch.tanh(self.fc(x))


class Builds(nn.Module):
    """Builds ``fc`` on its first call (a module added during the step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "fc"):
            self.fc = nn.Linear(x.shape[-1], 4)
        return torch.tanh(self.fc(x))


def _profile(net: nn.Module, x: torch.Tensor) -> tuple[hs.MemoryProfile, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        prof = hs.memory_profile(net, x)
    return prof, [str(w.message) for w in got if issubclass(w.category, hs.HookscopeWarning)]


def _by_hand(x: torch.Tensor) -> dict[str, int]:
    """Bytes each module saves itself: fc its input (x), the tanh (in '0') its output (3 x 4),
    which the last Linear saves again (counted once, at '0')."""
    return {"0.fc": x.numel() * F32, "0": x.shape[0] * 4 * F32, "1": 0, "": 0}


def _saved(prof: hs.MemoryProfile) -> dict[str, int]:
    return {r: prof[r].saved_bytes for r in ("0.fc", "0", "1", "")}


def test_memory_profile_normal_path_matches_the_hand_count() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(Rebuilds(), nn.Linear(4, 1))
    x = torch.randn(3, 4)  # fc's width: nothing rebuilt
    prof, said = _profile(net, x)
    assert said == []
    assert _saved(prof) == _by_hand(x)
    assert prof["0.fc"].calls == 1 and prof["0.fc"].flops == 2 * 3 * 4 * 4


def test_memory_profile_module_replaced_during_the_step_is_named() -> None:
    # before: no warning; row '0.fc' with 0 calls and 0 bytes, its 72 bytes charged to '0'
    torch.manual_seed(0)
    net = nn.Sequential(Rebuilds(), nn.Linear(4, 1))
    x = torch.randn(3, 6)
    prof, said = _profile(net, x)
    assert len(said) == 1
    assert re.search(
        r"memory_profile: layer\(s\) '0\.fc' changed in the model during the profiled step "
        r"\(model\[0\]\.fc is now another Linear\), so the profile's hooks did not see their "
        r"calls: .* charged to the module that called them \('0' for '0\.fc'\).*Call the model "
        r"once before memory_profile \(a forward that builds model\[0\]\.fc builds it then\)",
        said[0],
    ), said[0]
    assert prof["0.fc"].calls == 0  # what the warning says: the new fc was not seen
    # the fix: profiled again, the model as built now
    prof, said = _profile(net, x)
    assert said == []
    assert _saved(prof) == _by_hand(x)
    assert prof["0.fc"].calls == 1


def test_memory_profile_module_added_during_the_step_is_named() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(Builds(), nn.Linear(4, 1))
    x = torch.randn(3, 5)
    prof, said = _profile(net, x)
    assert len(said) == 1
    assert "layer(s) '0.fc' changed in the model during the profiled step" in said[0]
    assert "(model[0].fc was added to the model (a Linear))" in said[0]
    assert "charged to the module that called them ('0' for '0.fc')" in said[0]
    prof, said = _profile(net, x)
    assert said == []
    assert _saved(prof) == _by_hand(x)


def test_memory_profile_hooks_removed_during_the_step_are_named() -> None:
    class Strips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hs.remove_hooks(self.fc)
            return torch.tanh(self.fc(x))

    torch.manual_seed(0)
    net = nn.Sequential(Strips(), nn.Linear(4, 1))
    _, said = _profile(net, torch.randn(3, 4))
    assert len(said) == 1
    assert re.search(
        r"memory_profile: its hooks on 1 layer\(s\) \('0\.fc'\) were removed by "
        r"hs\.remove_hooks\(\.\.\.\) during the profiled step.*do not call hs\.remove_hooks "
        r"while memory_profile runs",
        said[0],
    ), said[0]
    assert not hs.hooks_on(net)
