"""Audit s19: a scope whose hooks stop seeing a layer's calls while it is open says so.

Two ways a scope's hooks stop seeing a layer while the scope is open: the model gets another
module at the layer's name (``model.fc = nn.Linear(...)``, ``model.layers[0] = ...``: the
hooks stay on the module it replaced), or ``hs.remove_hooks(model)`` takes them. Before, a
capture read then said the layer "never ran" (false), or gave the replaced module's value (or
the one recorded before ``remove_hooks``) as the layer's last call without a word; an edit warned
"never ran", or nothing at all when the replaced module had run before. Each test checks the
message (the layer, the cause, the fix), and the normal paths give the exact values of a plain
hook written by hand.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import hookscope as hs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.seq = nn.Sequential(nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        for layer in self.layers:
            x = layer(x)
        return self.seq(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _x() -> torch.Tensor:
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(1))


def _hand(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The output of ``name`` in ``model(x)``, by a plain forward hook written by hand."""
    got: list[torch.Tensor] = []
    h = model.get_submodule(name).register_forward_hook(
        lambda m, i, o: got.append(o.detach().clone())
    )
    try:
        with torch.no_grad():
            model(x)
    finally:
        h.remove()
    assert len(got) == 1
    return got[0]


def _new_linear() -> nn.Linear:
    torch.manual_seed(5)
    return nn.Linear(3, 3)


# -- a module replaced while a capture is open ------------------------------------------------


def test_capture_of_a_module_replaced_inside_the_scope_names_it_and_the_fix() -> None:
    # before: LayerNotRunError "'fc' ... never called through module(...)", which was false
    model, x = _net(), _x()
    with hs.capture(model, ["fc"]) as cap:
        model.fc = _new_linear()
        model(x)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"layer 'fc' was replaced while this capture was open \(model\.fc is now another "
        r"module, a Linear\).*calls of the new module are not recorded.*open the capture after "
        r"replacing model\.fc",
    ):
        cap["fc"]
    with pytest.raises(hs.LayerNotRunError, match="replaced while this capture was open"):
        cap.calls("fc")


def test_capture_of_a_module_replaced_after_it_ran_refuses_the_stale_value() -> None:
    # before: cap["fc"] silently gave the replaced module's output of the first run as the
    # layer's last call, though the model's last run called the new module
    model, x = _net(), _x()
    old = model.fc
    with hs.capture(model, "fc") as cap:
        model(x)
        model.fc = _new_linear()
        model(x + 1)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"layer 'fc' was replaced while this capture was open \(model\.fc is now another "
        r"Linear\).*what was recorded is the replaced module's; open the capture after "
        r"replacing model\.fc",
    ):
        cap["fc"]
    assert old is not model.fc


def test_capture_glob_with_a_module_list_item_replaced_names_the_item() -> None:
    model, x = _net(), _x()
    old = model.layers[0]  # (held: the message names the class it replaced)
    with hs.capture(model, "layers.*") as cap:
        model.layers[0] = nn.Dropout(0.0)
        model(x)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"layer 'layers\.0' was replaced .*\(model\.layers\[0\] is now a Dropout, not "
        r"the Linear hooked there\).*open the capture after replacing model\.layers\[0\]",
    ):
        cap["layers.0"]
    assert old is not model.layers[0]
    # the other layer of the glob is exact
    torch.testing.assert_close(cap["layers.1"], _hand(model, "layers.1", x), rtol=0, atol=0)


def test_capture_of_a_sequential_item_replaced() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "seq.0") as cap:
        model.seq[0] = _new_linear()
        model(x)
    with pytest.raises(hs.LayerNotRunError, match=r"model\.seq\[0\] is now another module"):
        cap["seq.0"]


def test_capture_inputs_of_a_replaced_module() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "fc", inputs=True) as cap:
        model.fc = _new_linear()
        model(x)
    with pytest.raises(hs.LayerNotRunError, match="layer 'fc' was replaced"):
        cap.inputs["fc"]
    with pytest.raises(hs.LayerNotRunError, match="layer 'fc' was replaced"):
        cap.grads["fc"]


def test_capture_stop_of_a_replaced_module_says_so_at_exit() -> None:
    # before: "capture(stop=True): layer(s) 'fc' of Net never ran ..."
    model, x = _net(), _x()
    with (
        pytest.raises(
            hs.LayerNotRunError,
            match=r"capture\(stop=True\): layer 'fc' was replaced while this capture was open.*"
            r"open the capture after replacing model\.fc",
        ),
        hs.capture(model, "fc", stop=True),
    ):
        model.fc = _new_linear()
        model(x)


def test_capture_read_after_a_replacement_made_once_the_scope_closed_is_exact() -> None:
    model, x = _net(), _x()
    want = _hand(model, "fc", x)
    with hs.capture(model, "fc") as cap:
        model(x)
    model.fc = _new_linear()  # after the scope: what it recorded is the layer's own call
    torch.testing.assert_close(cap["fc"], want, rtol=0, atol=0)


def test_selection_built_before_a_replacement_hooks_the_new_module() -> None:
    # hs.find's {name: module} is resolved again by name when the scope opens: the new module
    model, x = _net(), _x()
    chosen = hs.find(model, "fc")
    model.fc = _new_linear()
    with hs.capture(model, chosen) as cap:
        model(x)
    torch.testing.assert_close(cap["fc"], _hand(model, "fc", x), rtol=0, atol=0)


def test_capture_with_nothing_replaced_is_exact_and_quiet() -> None:
    model, x = _net(), _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.capture(model, ["fc", "layers.0", "seq.0"]) as cap:
            model(x)
        for name in ("fc", "layers.0", "seq.0"):
            torch.testing.assert_close(cap[name], _hand(model, name, x), rtol=0, atol=0)


# -- hs.remove_hooks while a capture is open ---------------------------------------------------


def test_capture_whose_hooks_remove_hooks_took_says_so_not_never_ran() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "fc") as cap:
        assert hs.remove_hooks(model) == 1
        model(x)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"the hooks of this capture were removed by hs\.remove_hooks\(\.\.\.\) while it "
        r"was open, so 'fc' recorded nothing after that \(and nothing before\): keep "
        r"hs\.remove_hooks for scopes that were never closed",
    ) as info:
        cap["fc"]
    assert "never called" not in str(info.value)


def test_capture_read_after_remove_hooks_warns_that_later_calls_are_missing() -> None:
    # before: the first run's value, silently, though the model ran again after the removal
    model, x = _net(), _x()
    want = _hand(model, "fc", x)
    with hs.capture(model, "fc") as cap:
        model(x)
        hs.remove_hooks(model)
        model(x + 1)
    with pytest.warns(
        hs.HookscopeWarning,
        match=r"removed by hs\.remove_hooks\(\.\.\.\) while it was open, so 'fc' recorded "
        r"nothing after that: the values read are those recorded before it",
    ):
        got = cap["fc"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the value recorded, exact


def test_capture_stop_whose_hooks_remove_hooks_took() -> None:
    model, x = _net(), _x()
    with (
        pytest.raises(
            hs.LayerNotRunError,
            match=r"capture\(stop=True\): the hooks of this capture were removed by "
            r"hs\.remove_hooks",
        ),
        hs.capture(model, "fc", stop=True),
    ):
        hs.remove_hooks(model)
        model(x)


def test_remove_hooks_on_a_scope_never_closed_is_quiet() -> None:
    # its documented use: no warning when it removes, and the values recorded stay readable
    # (a read of a layer it took hooks from warns, once: calls after it are missing)
    model, x = _net(), _x()
    want = _hand(model, "layers.1", x)
    cap = hs.capture(model, "layers.1")
    model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hs.remove_hooks(model) == 1
    with pytest.warns(hs.HookscopeWarning, match="'layers.1' recorded nothing after that"):
        torch.testing.assert_close(cap["layers.1"], want, rtol=0, atol=0)
    cap.remove()


# -- edit, edit_grads, clip_grads ---------------------------------------------------------------


def test_edit_of_a_module_replaced_inside_the_scope_warns_naming_it() -> None:
    # before: "edit: layer(s) 'fc' never ran while the scope was open ..."
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit: layer\(s\) 'fc' were replaced while the scope was open \(model\.fc is "
            r"now another module, a Linear\), so the new one was not edited.*open the scope after "
            r"replacing model\.fc",
        ) as rec,
        hs.edit(model, {"fc": hs.ops.zero()}),
    ):
        model.fc = _new_linear()
        with torch.no_grad():
            out = model(x)
    assert not any("never ran" in str(w.message) for w in rec)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # not edited, as said


def test_edit_of_a_module_replaced_after_it_ran_warns() -> None:
    # before: silent (the replaced module had been edited once, so no "never ran")
    model, x = _net(), _x()
    with pytest.warns(
        hs.HookscopeWarning,
        match=r"edit: layer\(s\) 'layers\.0' were replaced while the scope was open "
        r"\(model\.layers\[0\] is now another Linear\)",
    ):
        keep = model.layers[0]
        with hs.edit(model, {"layers.0": hs.ops.zero()}):
            model(x)
            model.layers[0] = _new_linear()
            model(x)
    assert keep is not model.layers[0]


def test_edit_whose_hooks_remove_hooks_took_says_so_not_never_ran() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit: the hooks of this edit were removed by hs\.remove_hooks\(\.\.\.\) while "
            r"it was open, so layer\(s\) 'fc' were not edited after that \(nor before that\); keep "
            r"hs\.remove_hooks for scopes that were never closed, or open a new edit after it",
        ) as rec,
        hs.edit(model, {"fc": hs.ops.zero()}),
    ):
        hs.remove_hooks(model)
        model(x)
    assert not any("never ran" in str(w.message) for w in rec)


def test_edit_remove_hooks_after_a_call_says_it_was_edited_before() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"'fc' were not edited after that \('fc' edited before that\)",
        ),
        hs.edit(model, {"fc": hs.ops.zero()}),
    ):
        model(x)
        hs.remove_hooks(model)
        model(x)


def test_edit_with_nothing_replaced_is_exact_and_quiet() -> None:
    model, x = _net(), _x()
    h = model.fc.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    with torch.no_grad():
        want = model(x)
    h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.edit(model, {"fc": hs.ops.zero()}), torch.no_grad():
            got = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_edit_grads_of_a_replaced_module_and_of_removed_hooks() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit_grads: layer\(s\) 'fc' were replaced while the scope was open",
        ) as rec,
        hs.edit_grads(model, {"fc": hs.ops.zero()}),
    ):
        model.fc = _new_linear()
        model(x).sum().backward()
    assert not any("never ran" in str(w.message) for w in rec)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit_grads: the hooks of this edit_grads were removed by hs\.remove_hooks",
        ) as rec,
        hs.edit_grads(model, {"fc": hs.ops.zero()}),
    ):
        hs.remove_hooks(model)
        model(x).sum().backward()
    assert not any("never ran" in str(w.message) for w in rec)


def test_edit_grads_of_a_parameter_whose_hook_remove_hooks_took() -> None:
    # before: "parameter(s) 'fc.bias' got no gradient while the scope was open" (it got one)
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit_grads: the hooks of this edit_grads were removed by hs\.remove_hooks"
            r"\(\.\.\.\) while it was open, so parameter\(s\) 'fc\.bias' were not edited after that;",
        ) as rec,
        hs.edit_grads(model, {"fc.bias": hs.ops.zero()}),
    ):
        hs.remove_hooks(model)
        model(x).sum().backward()
    assert not any("got no gradient" in str(w.message) for w in rec)
    assert model.fc.bias.grad.abs().sum() > 0  # not edited, as said


def test_clip_grads_of_a_replaced_parameter_warns() -> None:
    # before: silent; the new parameter's gradient was not clipped
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"clip_grads: parameter\(s\) 'fc\.weight' were replaced while the scope was open "
            r"\(model\.fc\.weight is now another Parameter \(shape \(3, 3\)\)\), so the new one was "
            r"not clipped.*open the scope after replacing model\.fc\.weight",
        ),
        hs.clip_grads(model, value=1e-3),
    ):
        model.fc.weight = nn.Parameter(torch.ones(3, 3))
        (model(x) * 100).sum().backward()
    assert model.fc.weight.grad.abs().max() > 1e-3  # not clipped, as said
    assert model.fc.bias.grad.abs().max() <= 1e-3  # the others are


def test_clip_grads_whose_hooks_remove_hooks_took_says_so() -> None:
    # before: "no parameter got a gradient while the scope was open" (each got one)
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"clip_grads: the hooks of this clip_grads were removed by hs\.remove_hooks",
        ) as rec,
        hs.clip_grads(model, value=1e-3),
    ):
        hs.remove_hooks(model)
        model(x).sum().backward()
    assert not any("no parameter got a gradient" in str(w.message) for w in rec)


def test_clip_grads_with_nothing_replaced_is_exact_and_quiet() -> None:
    model, x = _net(), _x()
    ref = _net()
    (ref(x) * 100).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.clip_grads(model, value=1e-3):
            (model(x) * 100).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad.clamp(-1e-3, 1e-3), rtol=0, atol=0, msg=name)


def test_edit_grads_of_a_replaced_parameter_warns() -> None:
    # before: "parameter(s) 'fc.bias' got no gradient while the scope was open" (the new one got one)
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit_grads: parameter\(s\) 'fc\.bias' were replaced while the scope was open "
            r"\(model\.fc\.bias is now another Parameter \(shape \(3,\)\)\), so the new one was not "
            r"edited.*open the scope after replacing model\.fc\.bias",
        ) as rec,
        hs.edit_grads(model, {"fc.bias": hs.ops.zero()}),
    ):
        model.fc.bias = nn.Parameter(torch.zeros(3))
        model(x).sum().backward()
    assert not any("got no gradient" in str(w.message) for w in rec)
    assert all(w.filename == __file__ for w in rec)  # (points at the with block)


# -- observe and trace: calls of the new module were missed without a word ---------------------


def test_observe_of_a_module_replaced_after_it_ran_warns() -> None:
    # before: silent; fn saw the first run's 'fc' call and never the new module's
    model, x = _net(), _x()
    seen: list[tuple[str, torch.Tensor]] = []
    with pytest.warns(
        hs.HookscopeWarning,
        match=r"observe: layer\(s\) 'fc' were replaced while the scope was open \(model\.fc is "
        r"now another Linear\), so the new one was not observed.*open the scope after replacing "
        r"model\.fc",
    ):
        old = model.fc
        with hs.observe(model, ["fc", "seq.0"], lambda c: seen.append((c.layer, c.output))):
            model(x)
            model.fc = _new_linear()
            model(x)
    assert old is not model.fc
    assert [n for n, _ in seen] == ["fc", "seq.0", "seq.0"]
    torch.testing.assert_close(seen[2][1].detach(), _hand(model, "seq.0", x), rtol=0, atol=0)


def test_observe_whose_hooks_remove_hooks_took_warns() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"observe: the hooks of this observe were removed by hs\.remove_hooks\(\.\.\.\) "
            r"while it was open, so layer\(s\) 'fc' were not observed after that \(nor before that\)",
        ),
        hs.observe(model, "fc", lambda c: None),
    ):
        hs.remove_hooks(model)
        model(x)


def test_trace_of_every_module_with_one_replaced_warns() -> None:
    model, x = _net(), _x()
    old = model.layers[1]  # (held: the message names it)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"trace: layer\(s\) 'layers\.1' were replaced while the scope was open "
            r"\(model\.layers\[1\] is now another Linear\), so the new one was not traced",
        ),
        hs.trace(model, quiet=True) as tr,
    ):
        model.layers[1] = _new_linear()
        model(x)
    assert old is not model.layers[1]
    assert [e.layer for e in tr.events] == ["", "fc", "layers.0", "seq", "seq.0"]


def test_observe_and_trace_with_nothing_replaced_are_exact_and_quiet() -> None:
    model, x = _net(), _x()
    seen: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        obs = hs.observe(model, "layers.1", lambda c: seen.append(c.output.detach().clone()))
        with obs, hs.trace(model, quiet=True) as tr, torch.no_grad():
            model(x)
    torch.testing.assert_close(seen[0], _hand(model, "layers.1", x), rtol=0, atol=0)
    assert [e.layer for e in tr.events] == ["", "fc", "layers.0", "layers.1", "seq", "seq.0"]


# -- steer (a product on HookScope): its "did not run" / "never ran" were false ----------------


def test_steer_of_a_module_replaced_inside_the_scope_warns_naming_it() -> None:
    # before: "steer: layers 'fc' did not run during model call 0 ... A compiled forward ..."
    model, x = _net(), _x()
    old = model.fc
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"steer: layer\(s\) 'fc' were replaced while the scope was open \(model\.fc is now "
            r"another Linear\), so the new one was not steered.*open the scope after replacing "
            r"model\.fc",
        ) as rec,
        hs.steer(model, {"fc": torch.ones(3)}),
        torch.no_grad(),
    ):
        model(x)
        model.fc = _new_linear()
        out = model(x)
        model(x)
    assert old is not model.fc
    assert len(rec) == 1, [str(w.message) for w in rec]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # not steered, as said


def test_steer_whose_hooks_remove_hooks_took_says_so_not_never_ran() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"steer: the hooks of this steer were removed by hs\.remove_hooks\(\.\.\.\) while "
            r"it was open, so layer\(s\) 'fc' were not steered after that \(nor before that\)",
        ) as rec,
        hs.steer(model, {"fc": torch.ones(3)}),
    ):
        hs.remove_hooks(model)
        model(x)
    assert len(rec) == 1, [str(w.message) for w in rec]


def test_steer_with_nothing_replaced_is_exact_and_quiet() -> None:
    model, x = _net(), _x()
    h = model.fc.register_forward_hook(lambda m, i, o: o + torch.ones(3))
    with torch.no_grad():
        want = model(x)
    h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.steer(model, {"fc": torch.ones(3)}), torch.no_grad():
            got = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_clip_grads_of_a_parameter_moved_by_a_parametrization_is_exact_and_quiet() -> None:
    # not replaced: register_parametrization moves fc.weight to
    # fc.parametrizations.weight.original, the same tensor, whose hook still clips
    class Same(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w

    model, x = _net(), _x()
    ref = _net()
    (ref(x) * 100).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.clip_grads(model, value=1e-3):
            torch.nn.utils.parametrize.register_parametrization(model.fc, "weight", Same())
            (model(x) * 100).sum().backward()
    moved = model.fc.parametrizations.weight.original
    torch.testing.assert_close(moved.grad, ref.fc.weight.grad.clamp(-1e-3, 1e-3), rtol=0, atol=0)


def test_edit_of_a_layer_removed_from_the_model_says_removed() -> None:
    # before: "never ran while the scope was open" (it was taken out of the model)
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit: layer\(s\) 'seq\.0' were removed from the model while the scope was open "
            r"\(model\.seq\[0\] is no longer in the model\), so its later uses were not edited.*open "
            r"the scope after removing model\.seq\[0\]",
        ) as rec,
        hs.edit(model, {"seq.0": hs.ops.zero()}),
    ):
        del model.seq[0]
        model(x)
    assert len(rec) == 1, [str(w.message) for w in rec]


def test_capture_of_a_layer_removed_from_the_model_says_removed() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "seq.0") as cap:
        model(x)
        del model.seq[0]
        model(x)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"layer 'seq\.0' was removed from the model while this capture was open "
        r"\(model\.seq\[0\] is no longer in the model\): what was recorded is of the module "
        r"that was there; open the capture after removing model\.seq\[0\]",
    ):
        cap["seq.0"]


# -- a deep copy ran the layer: "never called through module(...)" was false -------------------


def test_capture_of_a_layer_only_a_deep_copy_ran_says_so() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "fc") as cap:
        twin = copy.deepcopy(model)  # its hooks are inert copies
        twin(x)
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"layer 'fc' was selected but nothing was recorded: a deep copy of the model "
        r"\(copy\.deepcopy, made while the capture was open\) called 'fc', and a copy's hooks "
        r"are inert: capture the copy",
    ):
        cap["fc"]
    assert hs.remove_hooks(twin) == 1  # (the inert copy)


def test_edit_of_a_layer_only_a_deep_copy_ran_says_so() -> None:
    model, x = _net(), _x()
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"edit: layer\(s\) 'fc' ran only in a deep copy of the model \(copy\.deepcopy, "
            r"made while the scope was open\), whose hooks are inert, so nothing was edited there: "
            r"open the edit on the copy",
        ) as rec,
        hs.edit(model, {"fc": hs.ops.zero()}),
    ):
        twin = copy.deepcopy(model)
        twin(x)
    assert len(rec) == 1, [str(w.message) for w in rec]
    hs.remove_hooks(twin)


def test_capture_of_the_model_beside_a_deep_copy_is_exact() -> None:
    model, x = _net(), _x()
    with hs.capture(model, "fc") as cap:
        twin = copy.deepcopy(model)
        twin(x + 1)
        model(x)
    torch.testing.assert_close(cap["fc"], _hand(model, "fc", x), rtol=0, atol=0)
    assert len(cap.calls("fc")) == 1
    hs.remove_hooks(twin)


# -- what an open scope says of itself after hs.remove_hooks -------------------------------------


def test_scope_after_remove_hooks_reports_no_hooks_held() -> None:
    # before: cap.active was True and the scope counted 2 hooks that were gone
    model, x = _net(), _x()
    cap = hs.capture(model, ["fc", "seq.0"])
    scope = cap._scope
    assert cap.active and scope.num_hooks == 2
    hs.remove_hooks(model.fc)
    assert cap.active and scope.num_hooks == 1  # seq.0's is still there
    hs.remove_hooks(model)
    assert not cap.active and scope.num_hooks == 0
    assert "0 hooks" in repr(scope) and "closed" in repr(cap)
    cap.remove()
    with hs.capture(model, "fc", inputs=True) as cap:  # (handles, not direct hooks)
        assert cap._scope.num_hooks == 2
        model(x)
        hs.remove_hooks(model)
        assert not cap.active and cap._scope.num_hooks == 0
    with pytest.warns(hs.HookscopeWarning, match="'fc' recorded nothing after that"):
        torch.testing.assert_close(cap.inputs["fc"].args[0], x, rtol=0, atol=0)


def test_tracking_scopes_do_not_keep_the_model_alive() -> None:
    # the scopes remember where their hooks sit by weak references and names: `del model`
    # frees it by reference counting alone (docs/pitfalls.md §21), with every kind open
    gc.disable()
    try:
        model, x = _net(), _x()
        ref = weakref.ref(model)
        scopes = [
            hs.capture(model, ["fc", "seq.0"], inputs=True),
            hs.edit(model, {"fc": hs.ops.scale(1.0)}),
            hs.edit_grads(model, {"fc": hs.ops.scale(1.0), "fc.bias": hs.ops.scale(1.0)}),
            hs.clip_grads(model, value=1.0),
            hs.observe(model, "fc", lambda c: None),
            hs.trace(model, quiet=True),
            hs.steer(model, {"fc": torch.zeros(3)}),
        ]
        model(x).sum().backward()
        del model
        assert ref() is None, "the model outlived `del` (a reference held by a scope)"
        for s in scopes:
            s.remove()  # (the model is gone: nothing to say of where the hooks sat)
    finally:
        gc.enable()


# -- Monitor (a product on HookScope): a replaced layer's statistics went missing silently -------


def test_monitor_of_a_layer_replaced_between_steps_warns_once_and_follows_it() -> None:
    # before: from step 1 on the record silently had no '0' (its hooks were on the old module);
    # then (this session) said, but missing for the rest of the run: now the next logged step
    # watches the module the model holds, its statistics those of a hand forward
    model, x = _net(), _x()
    seq = nn.Sequential(model.fc, nn.ReLU(), nn.Linear(3, 1))
    with pytest.warns(
        hs.MonitorWarning,
        match=r"step 1: layer\(s\) '0' were replaced in the model while the Monitor watched it "
        r"\(model\[0\] is now another Linear\): .*statistics are missing from this step and "
        r"are recorded from the next logged step on.*create the Monitor after replacing "
        r"model\[0\] to have them from the start",
    ) as rec:
        old = seq[0]
        mon = hs.Monitor(seq, every=1, stats="activations")
        records = []
        for step in range(3):
            if step == 1:
                seq[0] = _new_linear()
            seq(x).sum().backward()
            records.append(mon.step())
        mon.close()
    assert old is not seq[0]
    assert len([w for w in rec if "replaced" in str(w.message)]) == 1  # once, not per step
    assert "0" in records[0].layers and "0" not in records[1].layers
    with torch.no_grad():
        out = seq[0](x)  # the new module, by hand (no optimizer: the same weights as in step 2)
    got = records[2].layers["0"]
    assert got["absmax"] == pytest.approx(float(out.abs().max()), rel=1e-6)
    assert got["mean"] == pytest.approx(float(out.double().mean()), rel=1e-6, abs=1e-9)


def test_monitor_step_whose_hooks_remove_hooks_took_says_so() -> None:
    # before: "step 0: no monitored layer ran ... was the model called ...?" (it was)
    model, x = _net(), _x()
    with pytest.warns(
        hs.MonitorWarning,
        match=r"step 0: the hooks of this Monitor were removed by hs\.remove_hooks\(\.\.\.\) "
        r"during the step, so layer\(s\) 'fc', 'layers\.0', 'layers\.1' \.\.\. recorded nothing "
        r"after that; the Monitor places them again at its next logged step",
    ) as rec:
        mon = hs.Monitor(model, every=1, stats="activations")
        hs.remove_hooks(model)
        model(x).sum().backward()
        mon.step()
        mon.close()
    assert not any("no monitored layer ran" in str(w.message) for w in rec)


def test_monitor_statistics_with_nothing_replaced_are_exact() -> None:
    model, x = _net(), _x()
    want = _hand(model, "layers.0", x).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon = hs.Monitor(model, every=1, stats="activations")
        model(x).sum().backward()
        record = mon.step()
        mon.close()
    got = record.layers["layers.0"]
    assert got["absmax"] == pytest.approx(want.abs().max().item(), rel=0, abs=0)
    assert got["mean"] == pytest.approx(want.mean().item(), rel=1e-6)


# -- FeatureExtractor: its selection is kept between calls ---------------------------------------


def test_feature_extractor_follows_a_layer_replaced_after_it_was_made() -> None:
    # before: LayerNotRunError "layer(s) 'fc' ... never ran during this forward pass" (false:
    # the extractor hooked the module it found when it was made, which the model no longer calls)
    model, x = _net(), _x()
    fx = hs.FeatureExtractor(model, ["fc", "layers.1"], detach=True)
    first = fx(x)
    torch.testing.assert_close(first["fc"], _hand(model, "fc", x), rtol=0, atol=0)
    model.fc = _new_linear()
    model.layers[1] = _new_linear()
    got = fx(x)
    for name in ("fc", "layers.1"):
        torch.testing.assert_close(got[name], _hand(model, name, x), rtol=0, atol=0)
    assert not torch.equal(got["fc"], first["fc"])
    assert fx._named["fc"] is model.fc


def test_feature_extractor_of_a_layer_deleted_after_it_was_made_names_it() -> None:
    model, x = _net(), _x()
    fx = hs.FeatureExtractor(model, "seq.0")
    del model.seq[0]
    with pytest.raises(hs.LayerNotFoundError, match=r"no layer named 'seq\.0'"):
        fx(x)


# -- a CAM keeps its layers between calls, as FeatureExtractor does ------------------------------


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def _hand_grad_cam(model: _ConvNet, x: torch.Tensor, target: int) -> torch.Tensor:
    """Grad-CAM by plain hooks: relu(sum_c mean_hw(dS/dA_c) * A_c), before hookscope's resize."""
    kept: list[torch.Tensor] = []
    h = model.conv.register_forward_hook(lambda m, i, o: kept.append(o))
    try:
        score = model(x)[:, target].sum()
    finally:
        h.remove()
    (grad,) = torch.autograd.grad(score, kept[0])
    return torch.relu((grad.mean((2, 3), keepdim=True) * kept[0]).sum(1)).detach()


def test_cam_follows_a_target_layer_replaced_after_it_was_made() -> None:
    # before: CAMError "layer(s) 'conv' never ran during the forward pass" (false: the CAM
    # hooked the module it found when made, which the model no longer calls)
    torch.manual_seed(0)
    model, x = _ConvNet(), torch.randn(2, 3, 6, 6)
    cam = hs.GradCAM(model, "conv", raw=True)
    torch.manual_seed(3)
    model.conv = nn.Conv2d(3, 4, 3, padding=1)
    got = cam(x, target=1)
    torch.testing.assert_close(got, _hand_grad_cam(model, x, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        got, hs.GradCAM(model, "conv", raw=True)(x, target=1), rtol=0, atol=0
    )


def test_monitor_of_a_layer_removed_from_the_model_warns_once_without_following() -> None:
    """A monitored layer deleted from the model (del model.head) has nothing to follow: said once,
    missing from that step on; the other layers' statistics stay those of a hand forward."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body, self.head = nn.Linear(4, 3), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            return self.head(h) if hasattr(self, "head") else h

    net, x = Net(), torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    with pytest.warns(
        hs.MonitorWarning,
        match=r"step 1: layer\(s\) 'head' were replaced in the model.*no longer in the model.*"
        r"statistics are missing from this step on;",
    ) as rec:
        mon = hs.Monitor(net, every=1, stats="activations")
        records = []
        for step in range(3):
            if step == 1:
                del net.head
            net(x).sum().backward()
            records.append(mon.step())
        mon.close()
    assert len([w for w in rec if "'head'" in str(w.message)]) == 1
    assert "head" not in records[2].layers
    with torch.no_grad():
        out = net.body(x)
    assert records[2].layers["body"]["absmax"] == pytest.approx(float(out.abs().max()), rel=1e-6)
