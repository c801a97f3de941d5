"""Steering and threads: a scope acts only on the calls of the thread that created it, so a
``steer`` whose layers never ran in that thread (``generate`` in a background thread, as with
Transformers' ``TextIteratorStreamer``; or a model never called) warns at exit, naming the rule and
the fix; ``steering_vector`` says the same of a layer its model runs in a thread of its own."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.lm import tiny_gpt2

IDS = torch.tensor([[3, 4, 5, 6]])
GEN = dict(input_ids=IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _in_thread(fn, name="generator"):
    """Run ``fn()`` in a thread named ``name``; return its result (re-raise its exception)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the calling thread
            out.append(e)

    worker = threading.Thread(target=run, name=name)
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("positions", ["all", "generated"])
def test_steer_while_generate_runs_in_another_thread_warns_naming_the_thread(positions):
    """generate() in a background thread inside ``with hs.steer(...)`` is not steered (its tokens
    are those of the plain model) and the scope says so at exit, naming the thread and the fix."""
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    vec = torch.randn(model.config.n_embd) * 50
    plain = model.generate(**GEN)
    with hs.steer(model, {"transformer.h.0": vec}) as steering:
        steered = model.generate(**GEN)
    assert steering.ran > 0 and not torch.equal(steered, plain)  # the vector changes the tokens
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"'transformer.h.0' never ran in the thread that opened the scope, so nothing "
            r"was steered: their 4 calls from thread 'generator' were left alone.*acts only on "
            r"the calls of the thread that created it.*open the scope inside the function the "
            r"thread runs",
        ),
        hs.steer(model, {"transformer.h.0": vec}, positions=positions),
    ):
        elsewhere = _in_thread(lambda: model.generate(**GEN))
    assert torch.equal(elsewhere, plain)  # what the warning says: nothing was steered

    def steer_inside():  # the fix the warning gives
        with hs.steer(model, {"transformer.h.0": vec}):
            return model.generate(**GEN)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_in_thread(steer_inside), steered)
    assert hs.hooks_on(model) == []


def test_steer_whose_model_never_runs_warns():
    """A steering scope whose model is never called inside it (e.g. called after the block)
    steered nothing, and says so at exit naming the layer."""
    model = tiny_gpt2().eval()
    vec = torch.randn(model.config.n_embd)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"steer: layer\(s\) 'transformer.h.0' never ran while the scope was open, so "
            r"nothing was steered.*thread that created it",
        ),
        hs.steer(model, {"transformer.h.0": vec, "transformer.h.1": vec}) as steering,
    ):
        model.transformer.h[1](torch.randn(1, 2, model.config.n_embd))  # only h.1 runs
    assert steering.ran == 1


class _Threaded(nn.Module):
    """Runs ``inner`` in a thread of its own (as a model that parallelises its branches)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_thread(lambda: self.inner(x), name="branch-worker")


def test_steer_of_a_layer_the_model_runs_in_a_thread_of_its_own_warns_naming_the_thread():
    """The model's call is in the scope's thread but the steered layer runs in a thread the model
    starts: the layer is not steered (the output is the plain one) and the warning names the
    thread, not only a compiled forward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _Threaded())
    x = torch.randn(2, 4)
    plain = net(x)
    with (
        pytest.warns(
            hs.HookscopeWarning,
            match=r"'1.inner' did not run during model call 0.*ran in thread 'branch-worker'.*"
            r"acts only on the calls of the thread that created it",
        ),
        hs.steer(net, {"1.inner": torch.ones(4)}),
    ):
        out = net(x)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)


def test_steering_vector_of_a_layer_the_model_runs_in_a_thread_of_its_own_names_the_rule():
    """steering_vector's capture does not see a layer that the model runs in a thread it starts:
    the error says so (besides "read a layer that runs on token ids"); the layer the model calls
    in the scope's thread gives the hand-computed vector."""
    net = nn.Sequential(nn.Embedding(8, 4), _Threaded())
    with pytest.raises(
        hs.LayerNotRunError,
        match=r"'1.inner' did not run in the forward over the prompts.*in the thread that created "
        r"the scope.*a layer that the forward runs in a thread of its own is not seen",
    ):
        hs.steering_vector(net, [[1, 2]], [[1, 3]], "1.inner")
    got = hs.steering_vector(net, [[1, 2]], [[1, 3]], "1")["1"]  # the layer the scope's thread runs
    emb, inner = net[0].weight, net[1].inner
    torch.testing.assert_close(got, (inner(emb[2]) - inner(emb[3])).detach())
