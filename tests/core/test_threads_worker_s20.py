"""A layer the model's own forward runs in a worker thread (started and waited on inside the
forward): scopes act only on the calls of the thread that opened them, so those calls were left
out, and trace, observe, edit and steer said nothing of it (edit and a capture read blamed
"never called through module(...)"). Now the scope notes such calls (a worker its thread waits
on inside a call of the model; another thread running the model by itself stays its own, said
nowhere) and each says which layers and which thread; a capture read of a layer that ran in both
threads warns that the values are this thread's calls only (equal to a hand hook filtered to
this thread)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import hookscope as hs
from helpers.threads import Worker

THREAD = "a thread the forward starts"


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
SAID = f"'b.*' ran in thread '{THREAD}', which the model's forward started"


@pytest.mark.parametrize(
    "open_scope, verb",
    [
        (lambda m: hs.trace(m, quiet=True), "traced"),
        (lambda m: hs.observe(m, "b.0", lambda call: None), "observed"),
        (lambda m: hs.edit(m, {"b.0": lambda mod, args, out: out * 0}), "edited"),
        # steer says it in its own words where the layer never ran in this thread
        (lambda m: hs.steer(m, {"b": torch.ones(4)}), f"'b' ran in thread '{THREAD}'"),
        # and now also where it ran in both threads
        (lambda m: hs.steer(m, {"b": torch.ones(4)}), "steered"),
    ],
)
def test_scopes_say_the_calls_a_worker_thread_made(open_scope, verb):
    model = Worker(THREAD, both=verb == "steered")
    match = verb if verb.startswith("'") else f"{SAID} .* not {verb}"
    with pytest.warns(hs.HookscopeWarning, match=match) as said, open_scope(model):
        model(X)
    assert len([w for w in said if "ran in thread" in str(w.message)]) == 1


def test_capture_read_names_the_worker_thread():
    model = Worker(THREAD)
    with hs.capture(model, ["b.0", "c"]) as cap:
        model(X)
    with pytest.raises(hs.LayerNotRunError, match=f"'b.0' ran in thread '{THREAD}'"):
        cap["b.0"]
    with pytest.raises(hs.LayerNotRunError, match=f"'b.0' ran in thread '{THREAD}'"):
        hs.FeatureExtractor(model, ["b.0"])(X)


def test_capture_of_a_layer_run_in_both_threads_reads_this_threads_calls_and_says_so():
    model = Worker(THREAD, both=True)
    mine: list[torch.Tensor] = []  # a plain hook, keeping this thread's calls
    me = threading.get_ident()
    handle = model.b[0].register_forward_hook(
        lambda m, a, out: mine.append(out.detach().clone()) if threading.get_ident() == me else None
    )
    try:
        with hs.capture(model, "b.0", keep="all") as cap:
            model(X)
    finally:
        handle.remove()
    with pytest.warns(hs.HookscopeWarning, match="this thread only"):
        calls = cap.calls("b.0")
    assert len(calls) == len(mine) == 1
    assert torch.equal(calls[0].output, mine[0])


def test_another_thread_running_the_model_by_itself_is_its_own():
    model = Worker(THREAD)
    go = threading.Event()

    def other():
        go.wait()
        for _ in range(20):
            model.c(torch.randn(3, 4))

    t = threading.Thread(target=other)
    t.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.trace(model.c, quiet=True) as tr:
            go.set()
            for _ in range(20):
                model.c(torch.randn(3, 4))
            t.join()
    assert not tr.elsewhere
    assert len(tr.events) == 20
