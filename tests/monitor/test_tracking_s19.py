"""Audit s19: the NaN sentinel, find_nonfinite (and extract, summary: the other products that
run the model under hooks on its modules) when a module they hooked is replaced in the model,
added to it, or has its hooks taken by ``hs.remove_hooks`` while they watch it.

Before, the sentinel kept its hooks on the modules it found when the Monitor was made: a NaN made
by a module put in the model later was blamed on the layer that called it (the root) without a
word, and after ``hs.remove_hooks(model)`` the sentinel saw nothing for the rest of the run (a
NaN blamed on the last layer through its parameter gradient). Each test checks the warning's
content (the layer, what the model holds there now, the fix) and, on the normal path, the origin
against a hand reference: the first layer whose output is NaN while its input is finite.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import hookscope as hs


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))


def _negative(net: nn.Sequential) -> None:
    """Layer 0 maps ones to -1: a log after it makes NaN."""
    with torch.no_grad():
        net[0].weight.copy_(-torch.eye(2))
        net[0].bias.zero_()


def _positive(net: nn.Sequential) -> None:
    """Layer 0 maps ones to 2: a log after it stays finite."""
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(2))
        net[0].bias.fill_(1.0)


def _hand_origin(net: nn.Sequential, x: torch.Tensor) -> tuple[str, str]:
    """The first top-level layer whose output holds a NaN while its input does not (by hand)."""
    with torch.no_grad():
        for name, module in net.named_children():
            y = module(x)
            if y.isnan().any() and not x.isnan().any():
                return name, type(module).__name__
            x = y
    raise AssertionError("no NaN")


def _step(mon: hs.Monitor, net: nn.Module, x: torch.Tensor) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        net(x).sum().backward()
        rec = mon.step()
    net.zero_grad()
    return rec, [str(w.message) for w in got if issubclass(w.category, hs.MonitorWarning)]


X = torch.ones(4, 2)


class Grows(nn.Module):
    """Builds its activation on its first call (a module added to the model by its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "act"):
            self.act = Log()
        return self.act(self.fc(x))


def _grows() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(Grows(), nn.Linear(2, 1))
    with torch.no_grad():  # fc maps ones to -1: the log makes NaN
        net[0].fc.weight.copy_(-torch.eye(2))
        net[0].fc.bias.zero_()
    return net


def _hand_inner(net: nn.Sequential, x: torch.Tensor) -> tuple[str, str]:
    """By hand, for ``_grows()``: fc's output is finite, the log's NaN."""
    with torch.no_grad():
        h = net[0].fc(x)
        assert h.isfinite().all() and net[0].act(h).isnan().any()
    return "0.act", type(net[0].act).__name__


def test_sentinel_normal_path_matches_the_hand_origin() -> None:
    net = _net()
    net[1] = Log()
    _negative(net)
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off") as mon:
        rec, said = _step(mon, net, X)
    assert said == []
    assert (rec.nonfinite.layer, rec.nonfinite.module_type) == _hand_origin(net, X) == ("1", "Log")
    assert rec.nonfinite.phase == "forward" and rec.nonfinite.kind == "nan"


def test_sentinel_module_replaced_in_the_nan_step_says_the_origin_may_be_wrong() -> None:
    # before: origin '<root>' (Sequential), nothing said (the Log ran without the sentinel's hooks)
    net = _net()
    _positive(net)
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off") as mon:
        rec, said = _step(mon, net, X)
        assert rec.nonfinite is None and said == []
        net[1] = Log()
        _negative(net)
        rec, said = _step(mon, net, X)
        assert rec.nonfinite.layer == ""  # what the old hooks could see: the root
        assert len(said) == 1
        assert re.search(
            r"step 1: layer\(s\) '1' changed in the model while the Monitor's sentinel watched "
            r"it \(model\[1\] is now a Log, not the Tanh hooked there\).*the NaN/Inf origin found "
            r"\(layer '<root>' \(Sequential\), forward pass\) may be wrong.*create the Monitor "
            r"after replacing model\[1\]",
            said[0],
        ), said[0]
        # the sentinel watches the model as it is now: the next NaN's origin is exact
        rec, said = _step(mon, net, X)
        assert said == []
        assert (rec.nonfinite.layer, rec.nonfinite.module_type) == _hand_origin(net, X)


def test_sentinel_module_replaced_between_nan_free_steps_is_said_once_and_followed() -> None:
    # before: nothing said, and the NaN of a later step blamed on '<root>' (Sequential)
    net = _net()
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off") as mon:
        _positive(net)
        _step(mon, net, X)
        net[1] = Log()  # finite on positive inputs: no NaN this step
        rec, said = _step(mon, net, X)
        assert rec.nonfinite is None
        assert len(said) == 1 and "layer(s) '1' changed in the model" in said[0]
        assert "model[1] is now a Log, not the Tanh hooked there" in said[0]
        assert "create the Monitor after replacing model[1]" in said[0]
        rec, said = _step(mon, net, X)
        assert said == [] and rec.nonfinite is None  # said once
        _negative(net)
        rec, said = _step(mon, net, X)
        assert said == []
        assert (rec.nonfinite.layer, rec.nonfinite.module_type) == _hand_origin(net, X)


def test_sentinel_unlogged_step_checks_when_an_origin_is_found() -> None:
    # every=4: step 1 is not logged; the replacement is found with the origin (its step)
    net = _net()
    with hs.Monitor(net, sentinel=True, stats=("parameters",), every=4, alerts="off") as mon:
        _step(mon, net, X)
        net[1] = Log()
        _negative(net)
        rec, said = _step(mon, net, X)
        assert rec.nonfinite.layer == ""
        assert len(said) == 1 and "may be wrong" in said[0] and "model[1] is now a Log" in said[0]
        rec, said = _step(mon, net, X)
        assert (rec.nonfinite.layer, rec.nonfinite.module_type) == ("1", "Log")


def test_sentinel_module_added_in_the_nan_step_is_named() -> None:
    # a module built in the model's forward (new attribute): unhooked, its NaN blamed on the
    # parent; before, nothing said
    net = _grows()
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off") as mon:
        rec, said = _step(mon, net, X)
        assert rec.nonfinite.layer == "0"  # the parent (Grows), all the old hooks could see
        assert len(said) == 1
        assert "layer(s) '0.act' changed in the model" in said[0]
        assert "model[0].act was added to the model (a Log)" in said[0]
        assert "may be wrong" in said[0]
        assert "create the Monitor after adding model[0].act" in said[0]
        rec, said = _step(mon, net, X)
        assert said == []
        assert (rec.nonfinite.layer, rec.nonfinite.module_type) == ("0.act", "Log")


def test_sentinel_hooks_taken_by_remove_hooks_are_said_and_placed_again() -> None:
    # before: origin '2' (Linear) through its parameter gradient, nothing said, and the
    # sentinel saw nothing for the rest of the run
    net = _net()
    net[1] = Log()
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off") as mon:
        hs.remove_hooks(net)
        _negative(net)
        rec, said = _step(mon, net, X)
        assert len(said) == 1
        assert re.search(
            r"step 0: the sentinel's hooks on 4 layer\(s\) \('<root>', '0', '1' \.\.\.\) were "
            r"removed by hs\.remove_hooks\(\.\.\.\), so the sentinel did not see their calls.*"
            r"the NaN/Inf origin found \(layer '2' \(Linear\), backward pass\) may be wrong.*"
            r"keep hs\.remove_hooks for scopes that were never closed",
            said[0],
        ), said[0]
        rec, said = _step(mon, net, X)
        assert said == []
        assert (rec.nonfinite.layer, rec.nonfinite.module_type) == _hand_origin(net, X)
        assert hs.hooks_on(net)  # placed again
    assert not hs.hooks_on(net)


def test_sentinel_hooks_taken_in_a_nan_free_step_say_nothing_was_looked_for() -> None:
    net = _net()
    with hs.Monitor(net, sentinel=True, stats=(), alerts="off", every=3) as mon:
        _positive(net)
        _step(mon, net, X)  # step 0 is logged
        hs.remove_hooks(net[1])  # one layer's hooks
        rec, said = _step(mon, net, X)  # step 1: not logged, the taken hooks are seen anyway
        assert rec is None
        assert len(said) == 1
        assert "the sentinel's hooks on 1 layer(s) ('1') were removed" in said[0]
        assert "a NaN/Inf made after that was not looked for" in said[0]


@pytest.mark.parametrize("every", [1, 5])
def test_sentinel_steps_without_change_say_nothing(every: int) -> None:
    net = _net()
    with hs.Monitor(net, sentinel=True, every=every, alerts="off") as mon:
        for _ in range(6):
            _, said = _step(mon, net, X)
            assert said == []


# -- find_nonfinite -------------------------------------------------------------------------------
def _find(net: nn.Module, x: torch.Tensor) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        origin = hs.find_nonfinite(net, x)
    return origin, [str(w.message) for w in got if issubclass(w.category, hs.HookscopeWarning)]


def test_find_nonfinite_normal_path_matches_the_hand_origin() -> None:
    net = _net()
    net[1] = Log()
    _negative(net)
    origin, said = _find(net, X)
    assert said == []
    assert (origin.layer, origin.module_type) == _hand_origin(net, X) == ("1", "Log")


def test_find_nonfinite_module_built_by_the_forward_is_named() -> None:
    # before: origin '0' (Grows), nothing said (its Log was built during the run, unhooked)
    net = _grows()
    origin, said = _find(net, X)
    assert origin.layer == "0"
    assert len(said) == 1
    assert re.search(
        r"find_nonfinite: layer\(s\) '0\.act' changed in the model while find_nonfinite ran it "
        r"\(model\[0\]\.act was added to the model \(a Log\)\), so its hooks did not see "
        r"their calls: the origin found \(layer '0' \(Grows\), forward pass\) may be wrong.*"
        r"run the model once before find_nonfinite",
        said[0],
    ), said[0]
    origin, said = _find(net, X)  # the model as built now: exact
    assert said == []
    assert (origin.layer, origin.module_type) == _hand_inner(net, X)


def test_find_nonfinite_module_replaced_by_the_forward_is_named() -> None:
    class Swaps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if isinstance(self.act, nn.Tanh):
                self.act = Log()
            return self.act(x)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), Swaps(), nn.Linear(2, 1))
    _negative(net)
    origin, said = _find(net, X)
    assert origin.layer == "1"
    assert len(said) == 1
    assert "layer(s) '1.act' changed in the model while find_nonfinite ran it" in said[0]
    assert "(model[1].act is now a Log, not the Tanh hooked there)" in said[0]
    assert "the origin found (layer '1' (Swaps), forward pass) may be wrong" in said[0]
    origin, said = _find(net, X)
    assert said == [] and (origin.layer, origin.module_type) == ("1.act", "Log")


def test_find_nonfinite_hooks_removed_by_the_forward_are_named() -> None:
    class Strips(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hs.remove_hooks(self)
            return torch.log(x)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), Strips(), nn.Linear(2, 1))
    _negative(net)
    origin, said = _find(net, X)
    assert origin.layer == ""  # what the hooks left could see: the root
    assert len(said) == 1
    assert re.search(
        r"find_nonfinite: its hooks on 1 layer\(s\) \('1'\) were removed by "
        r"hs\.remove_hooks\(\.\.\.\) while it ran.*do not call hs\.remove_hooks in the "
        r"model's forward or loss_fn",
        said[0],
    ), said[0]
    assert not hs.hooks_on(net)


# -- other product scopes that run the model themselves: extract, summary -----------------------
class Swaps(nn.Module):
    """Rebuilds ``fc`` for the width of its input (a replacement during the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc.in_features != x.shape[-1]:
            self.fc = nn.Linear(x.shape[-1], 4)
        return torch.tanh(self.fc(x))


def _swaps() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Swaps(), nn.Linear(4, 1))


def _rows(n: int = 8) -> TensorDataset:
    return TensorDataset(torch.randn(n, 6, generator=torch.Generator().manual_seed(2)))


def test_extract_of_a_layer_the_forward_replaced_names_it(tmp_path) -> None:
    # before: LayerNotRunError "never ran during the forward pass (called via .forward()
    # directly, or not on this input's path)" (false: the forward replaced it)
    net = _swaps()
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"extract: layer\(s\) '0\.fc' changed in the model during the forward pass "
        r"\(model\[0\]\.fc is now another Linear\), so the new module ran without extract's "
        r"hook; run the model once before extract",
    ):
        hs.extract(net, _rows(), "0.fc", tmp_path / "a", batch_size=4, progress=False)
    assert not hs.hooks_on(net)
    # the fix, and the values against a hand forward
    feats = hs.extract(net, _rows(), "0.fc", tmp_path / "b", batch_size=4, progress=False)
    with torch.no_grad():
        want = net[0].fc(_rows().tensors[0]).numpy()
    np.testing.assert_allclose(feats["0.fc"], want, rtol=1e-6, atol=1e-7)


def test_summary_of_a_layer_the_forward_built_names_it() -> None:
    # before: "Never called through __call__ (1; counted in their parent): 0.fc" (false: it
    # was called, built by the forward after the summary's hooks were placed), no warning
    net = nn.Sequential(Grows(), nn.Linear(2, 1))
    x = torch.ones(3, 2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        s = hs.summary(net, x)
    said = [str(w.message) for w in got if issubclass(w.category, hs.HookscopeWarning)]
    assert len(said) == 1
    assert re.search(
        r"summary: layer\(s\) '0\.act' changed in the model during its forward \(model\[0\]\.act "
        r"was added to the model \(a Log\)\), so they ran without the summary's hooks.*counted "
        r"in the row of the layer that called them; run the model once before summary",
        said[0],
    ), said[0]
    assert "0.act" not in s.never_called
    # the fix: every row, FLOPs against a hand count (fc: 2 * 3 * 2 * 2 multiply-adds)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        s = hs.summary(net, x)
    assert [w for w in got if issubclass(w.category, hs.HookscopeWarning)] == []
    rows = {r.name: r for r in s.rows}
    assert {"0.fc", "0.act"} <= set(rows) and s.never_called == []
    assert rows["0.fc"].flops == 2 * 3 * 2 * 2
