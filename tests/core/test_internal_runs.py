"""A product's own runs of a model (hs.compare's runs and replays, a summary's forward, a CAM's,
find_nonfinite's: those that leave no trace on it) are not seen by the scopes watching that model
(a capture, a monitor, a record open around the call). Each of them kept those runs as the
model's own: a monitor's step statistics were those of compare's inputs, ``cap[name]`` the
output of compare's last run. A plain hook written by hand still sees every run (the reference
of what ran)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.core._scope import internal_run, quiet


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def test_a_monitor_s_step_is_the_user_s_run_not_compare_s():
    net, x, other = _net(), torch.randn(16, 4), 10 * torch.randn(16, 4)
    seen: list[float] = []
    handle = net[0].register_forward_hook(
        lambda m, i, o: seen.append(float(o.detach().abs().max()))
    )
    try:
        with hs.Monitor(net, alerts="off") as mon:
            net(x).pow(2).mean().backward()
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
            hs.compare(net, copy.deepcopy(net).bfloat16(), other, loss_fn=_loss)
            rec = mon.step()
    finally:
        handle.remove()
    assert len(seen) > 1  # compare did run the model: the hand-written hook saw it
    with torch.no_grad():
        want = float(net[0](x).abs().max())
    assert rec.layers["0"]["absmax"] == pytest.approx(want, rel=1e-6) and seen[0] == want
    for n, p in net.named_parameters():
        assert torch.equal(p.grad, grads[n])  # compare left .grad as found
        assert rec.params[n]["grad_norm"] == pytest.approx(float(grads[n].norm()), rel=1e-6)


def test_a_capture_holds_the_user_s_calls_only_around_a_summary_and_a_compare():
    net, x = _net(), torch.randn(3, 4)
    with hs.capture(net, ["0", "2"]) as cap:
        out = net(x)
        hs.summary(net, torch.randn(5, 4))
        hs.compare(net, copy.deepcopy(net), torch.randn(7, 4), loss_fn=_loss)
    assert [len(cap.calls(n)) for n in ("0", "2")] == [1, 1]
    assert torch.equal(cap["2"], out.detach())
    with torch.no_grad():
        assert torch.equal(cap["0"], net[0](x))


def test_a_record_around_a_summary_holds_the_user_s_run(tmp_path):
    """A summary inside the record's block: its forward was a second model call (refused, the
    record lost); the record now holds the user's run and compares exactly."""
    net, x = _net(), torch.randn(3, 4)
    with hs.record(net, tmp_path / "rec"):
        _loss(net(x)).backward()
        hs.summary(net, torch.randn(5, 4))
    net.zero_grad(set_to_none=True)
    report = hs.compare(str(tmp_path / "rec"), copy.deepcopy(net), x, loss_fn=_loss)
    assert report.culprit is None
    assert all(r.error == 0.0 and r.grad_error == 0.0 for r in report.rows), report


def test_quiet_is_per_thread_and_only_for_watching_scopes_open_before():
    """Another thread's capture keeps its calls during this thread's internal run; an editing
    scope (hs.edit) still acts inside one."""
    net, x = _net(), torch.randn(2, 4)
    with hs.capture(net, ["0"]) as cap:
        got: list[bool] = []
        with internal_run():
            scope_id = cap._scope.id
            assert quiet(scope_id)
            t = threading.Thread(target=lambda: got.append(quiet(scope_id)))
            t.start()
            t.join()
            net(x)
        assert got == [False] and not quiet(scope_id)
        net(x)
    assert len(cap.calls("0")) == 1
    with hs.edit(net, {"2": lambda out: out * 0}), internal_run():
        assert torch.equal(net(x), torch.zeros(2, 2))


def test_a_trace_around_a_summary_holds_the_user_s_calls():
    net, x = _net(), torch.randn(3, 4)
    with hs.trace(net) as tr:
        net(x)
        hs.summary(net, torch.randn(5, 4))
    plain = [e for e in tr.events if e.layer == "0"]
    assert len(plain) == 1 and plain[0].output_shapes == [3, 8]


def test_a_capture_around_a_patching_sweep_a_steering_vector_or_an_extraction_keeps_the_user_s(
    tmp_path,
):
    """patch_sweep, steering_vector and extract run the model many times for their own work: a
    capture open around them kept every one of those runs (``cap[name]`` the last sweep row's)."""
    from helpers.lm import tiny_gpt2, word_tokenizer

    model = tiny_gpt2(n_layer=2)
    ids = torch.tensor([[3, 7, 20, 8, 11], [3, 9, 20, 10, 11]])
    corrupt = torch.tensor([[3, 8, 20, 8, 11], [3, 10, 20, 10, 11]])

    def metric(out):
        return out.logits[:, -1, 7].mean()

    seen: list[torch.Tensor] = []  # the reference: a plain hook on a plain run

    def keep(m, i, o):
        seen.append((o[0] if isinstance(o, tuple) else o).detach().clone())

    handle = model.transformer.h[0].register_forward_hook(keep)
    try:
        model(ids)
    finally:
        handle.remove()
    want = seen[0]
    with hs.capture(model, ["transformer.h.0"]) as cap:
        model(ids)
        hs.patch_sweep(model, ids, corrupt, metric, ["transformer.h.0"])
        hs.steering_vector(model, ["i love the cat"], ["i hate the cat"], "transformer.h.1",
                           tokenizer=word_tokenizer("right"))  # fmt: skip
        data = [torch.randn(4) for _ in range(3)]
        hs.extract(_net(), data, ["0"], tmp_path / "feats", progress=False)
    assert len(cap.calls("transformer.h.0")) == 1
    got = cap["transformer.h.0"]
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_products_called_inside_a_record_s_block_leave_its_parameter_uses_alone(tmp_path):
    """A summary, a Grad-CAM, find_nonfinite or a compare inside a record's block read the
    model's parameters with gradients on (counting them, running the model): the record noted
    every parameter as used by the loss outside the model, and left their gradients out of the
    comparison. Each product's whole call is now an internal run."""
    import json

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(2, 3, 8, 8)
    twin = copy.deepcopy(net)
    with hs.record(net, tmp_path / "rec"):
        _loss(net(x)).backward()
        hs.summary(net, x)
        hs.GradCAM(net, "0")(x, target=0)
        hs.find_nonfinite(net, x)
        hs.compare(net, twin, x, loss_fn=_loss)
    assert json.loads((tmp_path / "rec" / "index.json").read_text()).get("outside") == []
    net.zero_grad(set_to_none=True)
    report = hs.compare(str(tmp_path / "rec"), twin, x, loss_fn=_loss)
    assert report.culprit is None
    assert [r.param_grad_error for r in report.rows if r.name in ("0", "3")] == [0.0, 0.0]


def test_a_product_s_warning_still_points_at_its_caller():
    """Entering the internal run must not move a product's warnings off the caller's line (a
    decorator did: they pointed at core/_scope.py)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 2)).train()  # fmt: skip
    with pytest.warns(hs.HookscopeWarning, match="batch statistics") as caught:
        hs.GradCAM(net, "0")(torch.randn(2, 3, 8, 8), target=0)
    assert {w.filename for w in caught if "batch statistics" in str(w.message)} == {__file__}
