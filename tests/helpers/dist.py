"""Helpers of the multi-process tests: 2 gloo ranks on loopback, and comparing monitor records."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn: Callable[..., None], args: tuple, world: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., None], *args: object, timeout: float = 300.0, world: int = WORLD
) -> None:
    """Run ``fn(rank, *args)`` on ``world`` (2) gloo ranks. The ranks are forked from a fork
    server (a fresh process that has imported torch and hookscope once per test process): a fork
    of the test process itself is unsafe once anything in it has started autograd's threads
    (PyTorch then refuses a backward in the child, "Unable to handle autograd's threading in
    combination with fork-based multiprocessing"), and which tests ran before depends on the
    order. ``fn`` must be a module-level function. A rank still running after ``timeout``
    seconds (one waiting in a collective the others never reach) is killed and the test fails,
    instead of hanging."""
    methods = mp.get_all_start_methods()
    method = "forkserver" if "forkserver" in methods else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "hookscope"])
    ctx = mp.start_processes(
        _entry, args=(free_port(), fn, args, world), nprocs=world, join=False, start_method=method
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            raise AssertionError(f"ranks {alive} still running after {timeout:.0f} s: a hang")


def read_jsonl(path: object) -> list[dict]:
    with open(path) as f:  # type: ignore[call-overload]
        return [json.loads(line) for line in f]


def assert_records_close(got: list[dict], ref: list[dict], steps: int) -> None:
    """Monitor records (``to_dict()``) of a multi-process run equal one process's, step by step."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(steps))
    for d, r in zip(got, ref):
        assert d["layers"].keys() == r["layers"].keys() and d["params"].keys() == r["params"].keys()
        for group in ("layers", "params"):
            for name, stats in r[group].items():
                assert stats.keys() == d[group][name].keys(), (group, name)
                for k, v in stats.items():
                    got_v = d[group][name][k]
                    if isinstance(v, str):  # "inf", "nan" in JSON
                        assert got_v == v, (group, name, k, got_v, v)
                        continue
                    assert math.isclose(got_v, v, rel_tol=1e-4, abs_tol=1e-7), (
                        group,
                        name,
                        k,
                        got_v,
                        v,
                    )
