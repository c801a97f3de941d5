"""Audit findings for core scopes (owner: core). Each test fails on main for the reason given."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
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
