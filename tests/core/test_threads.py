"""Threads: a scope acts only on the calls of the thread that created it.

Two threads running one model at the same time, each in its own scope, see only their own calls;
a thread running the model without a scope sees the plain model, whatever scope another thread
holds open. ``nn.DataParallel``'s worker threads (``parallel_apply``) count as the thread whose
call started them.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn as nn

import hookscope as hs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _together(*jobs: Callable[[], Any]) -> list[Any]:
    """Run ``jobs`` in threads started at the same moment; return their results (raise theirs)."""
    start = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int, job: Callable[[], Any]) -> None:
        try:
            start.wait()
            results[i] = job()
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


ROUNDS = 30


def test_two_threads_capturing_one_layer_each_get_only_their_own_calls() -> None:
    net = _net()
    xs = [torch.randn(ROUNDS, 1, 8), torch.randn(ROUNDS, 1, 8) + 5]

    def job(x: torch.Tensor) -> list[list[torch.Tensor]]:
        got = []
        for row in x:
            with hs.capture(net, "0") as cap:
                for _ in range(5):
                    net(row)
            got.append([c.output for c in cap.calls("0")])
        return got

    results = _together(lambda: job(xs[0]), lambda: job(xs[1]))
    for x, got in zip(xs, results):
        for row, outs in zip(x, got):
            expected = net[0](row).detach()  # the thread's own input through the layer by hand
            assert len(outs) == 5
            for out in outs:
                torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_an_edit_in_one_thread_leaves_another_threads_forwards_plain() -> None:
    net = _net()
    x = torch.randn(3, 8)
    with torch.no_grad():
        plain = net(x)
    stop = threading.Event()

    def editing() -> None:
        while not stop.is_set():
            with hs.edit(net, {"0": hs.ops.zero()}):
                zeroed = net(x)
            assert torch.equal(zeroed, net[2](torch.zeros(3, 8)))  # the edit acts in its thread

    def plain_calls() -> list[torch.Tensor]:
        try:
            with torch.no_grad():
                return [net(x) for _ in range(1000)]
        finally:
            stop.set()

    with torch.no_grad():
        _, outs = _together(editing, plain_calls)
    assert all(torch.equal(o, plain) for o in outs)


def test_a_steer_in_one_thread_leaves_another_threads_forwards_plain() -> None:
    net = _net()
    x = torch.randn(2, 8)
    vec = torch.ones(8)
    with torch.no_grad():
        plain = net(x)
        steered_ref = net[2](net[1](net[0](x) + 3 * vec))
    stop = threading.Event()

    def steering() -> None:
        while not stop.is_set():
            with hs.steer(net, {"0": vec}, scale=3.0):
                steered = net(x)
            torch.testing.assert_close(steered, steered_ref)

    def plain_calls() -> list[torch.Tensor]:
        try:
            return [net(x) for _ in range(1000)]
        finally:
            stop.set()

    with torch.no_grad():
        _, outs = _together(steering, plain_calls)
    assert all(torch.equal(o, plain) for o in outs)


def test_a_capture_with_gradients_in_one_thread_ignores_another_threads_training() -> None:
    net = _net()
    x = torch.randn(4, 8, requires_grad=True)
    stop = threading.Event()

    def capturing() -> list[tuple[torch.Tensor, torch.Tensor]]:
        got = []
        try:
            for _ in range(20):
                with hs.capture(net, "2", grads=True) as cap:
                    (net(x) * 2).sum().backward()
                got.append((cap["2"], cap.grads["2"]))
        finally:
            stop.set()
        return got

    def training() -> None:
        y = torch.randn(4, 8)
        while not stop.is_set():
            net(y).pow(2).sum().backward()

    got, _ = _together(capturing, training)
    expected = net(x).detach()
    for out, grad in got:
        assert len(out) == 4
        torch.testing.assert_close(out, expected)
        assert torch.equal(grad, torch.full((4, 4), 2.0))


def _cpu_parallel_apply(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``torch.nn.parallel.parallel_apply`` (what ``nn.DataParallel`` runs its replicas with),
    made to run on CPU threads: its accelerator calls are replaced by no-ops."""
    mod = importlib.import_module("torch.nn.parallel.parallel_apply")
    monkeypatch.setattr(mod, "_get_device_index", lambda d, optional=False: d)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda d=None: nullcontext())
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "device_index", lambda d: nullcontext())
    return mod.parallel_apply


def test_data_parallel_worker_threads_count_as_the_thread_that_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parallel_apply = _cpu_parallel_apply(monkeypatch)
    net = _net()
    x1, x2 = torch.randn(2, 8), torch.randn(3, 8)
    with torch.no_grad(), hs.capture(net, "0") as cap:
        outs = parallel_apply([net, net], [(x1,), (x2,)])
    got = sorted((c.output for c in cap.calls("0")), key=len)
    assert len(got) == 2
    torch.testing.assert_close(got[0], net[0](x1).detach())
    torch.testing.assert_close(got[1], net[0](x2).detach())
    with torch.no_grad(), hs.edit(net, {"0": hs.ops.zero()}):
        outs = parallel_apply([net, net], [(x1,), (x2,)])
    for o in outs:
        assert torch.equal(o, net[2](torch.zeros(len(o), 8)))


def test_data_parallel_replicas_in_worker_threads_get_unique_call_indices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # replicas share their hook dicts with the model and run them with the replica as `module`
    parallel_apply = _cpu_parallel_apply(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    xs = [torch.full((2, 4), float(i)) for i in range(8)]
    with torch.no_grad(), hs.capture(net, ["0", "1"]) as cap:
        for half in (xs[:4], xs[4:]):
            replicas = [net._replicate_for_data_parallel() for _ in range(4)]
            assert replicas[0][0]._forward_hooks is net[0]._forward_hooks
            parallel_apply(replicas, [(x,) for x in half])
    calls = cap.calls("0")
    assert sorted(c.index for c in calls) == list(range(8))
    got = sorted(c.output[0, 0].item() for c in calls)
    assert got == sorted(net[0](x)[0, 0].item() for x in xs)


def test_data_parallel_workers_of_another_thread_are_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parallel_apply = _cpu_parallel_apply(monkeypatch)
    net = _net()
    x = torch.randn(2, 8)
    opened = threading.Event()
    done = threading.Event()

    def holder() -> list[Any]:
        with hs.capture(net, "0") as cap:
            opened.set()
            done.wait(30)
        return cap.calls("0")

    def other() -> None:
        opened.wait(30)
        try:
            with torch.no_grad():
                parallel_apply([net, net], [(x,), (x,)])
        finally:
            done.set()

    calls, _ = _together(holder, other)
    assert calls == []
