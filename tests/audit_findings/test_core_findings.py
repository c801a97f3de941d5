"""Audit findings for core scopes (owner: core). Each test fails on main for the reason given."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.skip(reason="audit finding, not yet fixed")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_edit_returning_another_shape_is_refused_naming_the_layer():
    """User's edit of the last layer returns out[:1] (a slip that drops the batch): the model's
    output silently becomes (1, 2) instead of (3, 2); an edit that changes the output's shape
    should raise a HookscopeError naming the layer (as edit_grads' PyTorch check does, loudly)."""
    net, x = _net(), torch.randn(3, 4)
    with pytest.raises(hs.HookscopeError, match="'2'"), hs.edit(net, {"2": lambda out: out[:1]}):
        net(x)


def test_edit_returning_another_dtype_is_refused_naming_the_layer():
    """User's edit returns out.double(): the next layer fails with PyTorch's "mat1 and mat2 must
    have the same dtype, but got Double and Float", which names neither the edit nor the layer; it
    should be a HookscopeError naming layer '0' and the dtype expected (float32)."""
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.HookscopeError, match="'0'"),
        hs.edit(net, {"0": lambda out: out.double()}),
    ):
        net(x)


def test_edit_grads_returning_another_shape_names_the_layer():
    """User's gradient edit returns g[:1]: PyTorch raises "hook '<unknown>' has changed the size of
    value", naming no layer; it should be a HookscopeError naming layer '0' and the shape expected."""
    net, x = _net(), torch.randn(3, 4)
    with pytest.raises(hs.HookscopeError, match="'0'"), hs.edit_grads(net, {"0": lambda g: g[:1]}):
        net(x).sum().backward()


def test_edit_grads_on_a_layer_whose_backward_runs_after_the_scope_is_not_silent():
    """User edits layer '2''s output gradient (x0) but calls backward() after the with block:
    layer '0''s weight gradient is 1.26 (the edit never acted) and no warning is given, although
    the same slip with a parameter key warns "got no gradient while the scope was open"; it should
    warn the same way for a layer key."""
    net, x = _net(), torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with hs.edit_grads(net, {"2": lambda g: g * 0}):
            out = net(x)
        out.sum().backward()
    warned = any(issubclass(c.category, hs.HookscopeWarning) for c in w)
    assert warned or net[0].weight.grad.abs().max().item() == 0.0


def test_clip_grads_scope_that_clipped_nothing_warns():
    """User writes `with hs.clip_grads(net, value=1e-3): out = net(x)` and calls backward after
    the block: gradients reach 2.14 (nothing clipped), silently; like edit_grads' "parameter(s) ...
    got no gradient while the scope was open", clip_grads should warn at exit."""
    net, x = _net(), torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with hs.clip_grads(net, value=1e-3):
            out = net(x)
        out.sum().backward()
    warned = any(issubclass(c.category, hs.HookscopeWarning) for c in w)
    assert warned or net[2].weight.grad.abs().max().item() <= 1e-3


def test_sequence_error_for_a_generate_in_another_thread_names_the_thread():
    """User captures with sequence=True and runs model.generate in a background thread: the
    SequenceError says "the model was never called with token inputs (input_ids or inputs_embeds)",
    which is wrong (it was, in another thread); it should say the scope acts only on its own
    thread's calls, as LayerNotRunError's message does."""
    from helpers.lm import tiny_gpt2

    model = tiny_gpt2().eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with hs.capture(model, ["transformer.h.0"], sequence=True) as cap:
        worker = threading.Thread(target=model.generate, kwargs=kwargs)
        worker.start()
        worker.join()
    with pytest.raises(hs.HookscopeError, match="thread"):
        cap.sequence("transformer.h.0")


class _Checkpointed(nn.Module):
    """block -> tanh -> head, the block under torch.utils.checkpoint (as Transformers'
    gradient_checkpointing_enable() does) when ``ck``."""

    def __init__(self, ck: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)
        self.ck = ck

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ck:
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            h = self.block(x)
        return self.head(h.tanh())


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("scope", ["edit", "steer"])
def test_scope_closed_before_backward_gives_checkpointed_gradients_of_the_forward_it_edited(scope):
    """User edits (or steers) a layer inside a checkpointed block during the forward and calls
    loss.backward() after the with block (the usual training pattern): the recompute runs without
    the edit, so parameter gradients are those of an unedited forward, 0.51 (edit) / 2.37 (steer)
    away from the same step without checkpointing, silently; pitfalls.md §27 promises the same
    gradients with and without checkpointing. Expected: equal gradients (the recompute replays the
    hooks that were active at the call) or a HookscopeError/Warning."""
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ck in (True, False):
            model = _Checkpointed(ck)
            opened = (
                hs.edit(model, {"block.1": lambda o: o * 2})
                if scope == "edit"
                else hs.steer(model, {"block.1": torch.full((8,), 3.0)})
            )
            with opened:
                out = model(x)
            out.sum().backward()
            grads.append(_grads(model))
    if any(issubclass(w.category, hs.HookscopeWarning) for w in caught):
        return
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_edit_opened_only_around_backward_does_not_change_checkpointed_gradients():
    """User runs the forward of a model under hs.apply_checkpointing, then opens hs.edit around
    loss.backward() only: the recompute applies the edit to a forward that was never edited, and
    the parameter gradients differ from the plain step's by about 0.5, silently (without
    checkpointing the same code is a no-op that warns "never ran"). Expected: the plain step's
    gradients (a scope not open at the call does not act in its recompute), or a warning."""
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    model, plain = _Checkpointed(False), _Checkpointed(False)
    handle = hs.apply_checkpointing(model, ["block"])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(x)
            with hs.edit(model, {"block.1": lambda o: o * 2}):
                out.sum().backward()
    finally:
        handle.remove()
    plain(x).sum().backward()
    if any(issubclass(w.category, hs.HookscopeWarning) for w in caught):
        return
    for a, b in zip(_grads(model), _grads(plain)):
        torch.testing.assert_close(a, b)
