"""hs.compare and hs.record: their cost against plain steps, and how often each way of diffing two
runs names the faulty module on the fault suite.

Models: the fault suite's (``tests/helpers/faults.py``): a 2-layer Llama decoder (hidden 64,
GQA 4/2 heads, RoPE, RMSNorm; 2x12 tokens), a BatchNorm CNN (4x3x16x16) and a 2-layer ViT
(hidden 32, 2x3x16x16), tiny by design (a step of 1-4 ms, where the per-call cost of Python hooks
dominates); a wide Llama (4x512, 256 tokens) and the models ``bench_memory.py`` measures
(resnet18 at 4x3x64x64, a 4-layer torchvision ViT of width 128, a 4-block GPT-2 of width 128 on
4x64 tokens; eval mode), where compute does. CPU, one intra-op thread, contenders interleaved
(``_timing``).

Cost: one plain forward+backward of A plus one of B (a bf16 copy) against ``hs.compare(a, b,
loss_fn=...)`` (goal: <= 3x), and one plain step against the same step inside ``hs.record``
(goal: <= 1.5x plus the writing; the writing, timed apart: each value appended to
``values.bin`` and the exit's parameter gradients and index, median over the rounds). Writing
a record also slows what runs beside and after it (its bytes pass through the caches: the
wide Llama writes about 200 MB a step), which no timing of the writes sees: the last column
is the same record with nothing written (``Spool.write`` skipped, the exit not counted), the
hooks' own cost. The
records go to a memory-backed folder (``/dev/shm`` where there is one; ``--record-dir``): on
this machine's disk the kernel's write-back of a record (83 MB a step for resnet18) runs on the
same two cores during the next contenders' steps, a cost of the disk no timing of the writes
themselves sees (resnet18's (record - writing) / A read 1.66x there, 1.18x in memory).

Detection: for each fault (fp32 B, and bf16 B where the fault is one in bf16), whether
``report.culprit`` is the faulty module; whether the hand-written per-layer output diff (the
first module, in the order outputs are produced, whose relative output error exceeds a guessed
threshold: 1e-4 for fp32 pairs, 1e-2 for bf16 pairs) is; whether PyTorch DebugMode's
``check_hash_mismatches`` (first mismatching operator, attributed to the module it ran in) is.

Run: ``.venv/bin/python benchmarks/bench_compare.py [--rounds 5] [--skip-cost] [--skip-faults]
[--only NAME] [--record-dir DIR]``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import hookscope as hs
from _timing import interleaved, table
from helpers.faults import FAULTS, MODELS, faulty


def _step(model, inputs, kwargs, loss):
    model.zero_grad(set_to_none=True)
    loss(model(*inputs, **kwargs)).backward()


def _llama_wide():
    """A Llama decoder where compute, not per-call overhead, dominates: 4 layers, hidden 512,
    2x256 tokens."""
    from helpers.faults import _reinit
    from helpers.lm import tiny_llama

    model = _reinit(tiny_llama(n_layer=4, hidden=512, heads=8, kv_heads=2), 0)
    model.config.max_position_embeddings = 512
    ids = torch.randint(3, 40, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"use_cache": False}, lambda o: o.logits.float().logsumexp(-1).mean()


def _shared_models() -> list[tuple[str, object]]:
    """The models ``bench_memory.py`` measures (resnet18, a torchvision ViT, GPT-2), in eval mode
    (GPT-2's dropout would draw random numbers): sizes where a step takes tens of milliseconds."""
    from bench_memory import models

    def build(name):
        def made():
            model, inputs, loss = models()[name]
            return model.eval(), inputs, {}, loss or (lambda o: o.float().pow(2).mean())

        return made

    return [(name, build(name)) for name in models()]


class _Writing:
    """Seconds spent writing during ``hs.record``: each value appended to ``values.bin``
    (``Spool.write``: pickled, its bytes copied to the file) and the exit (parameter gradients,
    ``index.json``). With ``skip`` set, ``Spool.write`` writes nothing (the record that measures
    the hooks alone)."""

    def __init__(self) -> None:
        import importlib

        self.seconds = 0.0
        self.skip = False
        store = importlib.import_module("hookscope.compare._store")
        record = importlib.import_module("hookscope.compare._record")
        for owner, attr in ((store.Spool, "write"), (record.Record, "__exit__")):
            setattr(owner, attr, self._timed(getattr(owner, attr), attr == "write"))

    def _timed(self, fn, skippable):
        def timed(*args, **kwargs):
            if skippable and self.skip:
                return None
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


_WRITING: _Writing | None = None


def _record_dir(given: str) -> str | None:
    """Where the records go: ``given``, else ``/dev/shm`` (memory) where it exists, else the
    system's temporary folder (``None``)."""
    if given:
        return given
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


_RECORD_DIR: str | None = None


def _cost_row(name: str, build, rounds: int) -> list[str]:
    a, inputs, kwargs, loss = build()
    b = copy.deepcopy(a).to(torch.bfloat16)
    b_in = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)

    def plain_ab():
        _step(a, inputs, kwargs, loss)
        _step(b, b_in, kwargs, loss)

    def compare():
        hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)

    def plain_a():
        _step(a, inputs, kwargs, loss)

    writes: list[float] = []
    folders = tempfile.TemporaryDirectory(dir=_RECORD_DIR)
    made = iter(range(1 << 30))

    def record(skip: bool = False) -> None:  # into a new folder each time (made, removed untimed)
        a.zero_grad(set_to_none=True)
        before = _WRITING.seconds
        _WRITING.skip = skip
        try:
            with hs.record(a, Path(folders.name) / str(next(made))):
                loss(a(*inputs, **kwargs)).backward()
        finally:
            _WRITING.skip = False
        (exits if skip else writes).append(_WRITING.seconds - before)
        a.zero_grad(set_to_none=True)

    exits: list[float] = []
    t = interleaved(
        {"ab": plain_ab, "compare": compare, "a": plain_a, "record": record,
         "hooks": lambda: record(skip=True)},
        rounds,
    )  # fmt: skip
    folders.cleanup()
    w, e = statistics.median(writes), statistics.median(exits)
    return [
        name, f"{t['ab'] * 1e3:.1f}", f"{t['compare'] * 1e3:.1f}", f"{t['compare'] / t['ab']:.1f}x",
        f"{t['a'] * 1e3:.1f}", f"{t['record'] * 1e3:.1f}", f"{w * 1e3:.1f}",
        f"{(t['record'] - w) / t['a']:.2f}x", f"{(t['hooks'] - e) / t['a']:.2f}x",
    ]  # fmt: skip


def cost(rounds: int, only: str = "", record_dir: str = "") -> None:
    global _WRITING, _RECORD_DIR
    _WRITING = _Writing()
    _RECORD_DIR = _record_dir(record_dir)
    print(f"records written under {_RECORD_DIR or tempfile.gettempdir()}")
    models = [
        *MODELS.items(), ("llama wide (4x512, 256 tokens)", _llama_wide), *_shared_models()
    ]  # fmt: skip
    models = [(name, build) for name, build in models if only.lower() in name.lower()]
    rows = [_cost_row(name, build, rounds) for name, build in models]
    print(table(
        ["model", "A+B fwd+bwd ms", "compare ms", "compare / A+B", "A fwd+bwd ms", "record ms",
         "of which writing ms", "(record - writing) / A", "record, nothing written / A"],
        rows))  # fmt: skip


def _diff_verdict(report, threshold: float) -> str | None:
    over = sorted(
        (r.end, r.name) for r in report.rows if r.error is not None and r.error > threshold
    )
    return over[0][1] if over else None


def _debugmode_verdict(a, b, inputs, b_in, kwargs, loss) -> str | None:
    from torch.utils._debug_mode import DebugMode

    logs = []
    for m, x in ((a, inputs), (b, b_in)):
        m.zero_grad(set_to_none=True)
        with DebugMode(record_nn_module=True) as dm, DebugMode.log_tensor_hashes():
            loss(m(*x, **kwargs)).backward()
        logs.append(dm.logs)
        m.zero_grad(set_to_none=True)
    if not DebugMode.check_hash_mismatches(logs[0], logs[1]):
        return None  # raises ValueError when the operator sequences differ
    where: dict[int, str] = {}
    for x, y in zip(logs[0], logs[1]):
        if type(x).__name__ == "_AnnotateCall":
            where[x.call_depth] = str(x).split("] ", 1)[-1].strip()
            continue
        if type(x).__name__ != "_OpCall" or not getattr(x, "log", None):
            continue
        if x.log.get("hash") != y.log.get("hash"):
            module = where.get(x.call_depth - 1, "")
            return module.split(".", 1)[1] if "." in module else ""
    return None


def faults() -> None:
    rows, score = [], {"compare": 0, "diff": 0, "debugmode": 0, "cases": 0}
    secs = {"compare": 0.0, "diff": 0.0, "debugmode": 0.0}
    built = {k: f() for k, f in MODELS.items()}
    for fault in FAULTS:
        a, inputs, kwargs, loss = built[fault.model]
        for variant in ("fp32", "bf16"):
            if variant == "bf16" and not fault.bf16:
                continue
            b = faulty(a, fault)
            if variant == "bf16":
                b = b.to(torch.bfloat16)
            t0 = time.perf_counter()
            r = hs.compare(a, b, *inputs, loss_fn=loss, **kwargs)
            secs["compare"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            b_in = [
                t.to(torch.bfloat16) if variant == "bf16" and t.is_floating_point() else t
                for t in inputs
            ]
            with hs.capture(a, dict(a.named_modules())), hs.capture(b, dict(b.named_modules())):
                a(*inputs, **kwargs)
                b(*b_in, **kwargs)
            secs["diff"] += time.perf_counter() - t0
            diff = _diff_verdict(r, 1e-4 if variant == "fp32" else 1e-2)
            t0 = time.perf_counter()
            try:
                dm = _debugmode_verdict(a, b, inputs, b_in, kwargs, loss)
            except (ValueError, AssertionError, RuntimeError) as e:
                dm = f"raised {type(e).__name__}"
            secs["debugmode"] += time.perf_counter() - t0
            ok = [r.culprit == fault.culprit, diff == fault.culprit, dm == fault.culprit]
            for k, v in zip(("compare", "diff", "debugmode"), ok):
                score[k] += v
            score["cases"] += 1
            rows.append([fault.id, variant, r.culprit, diff, dm])
    print(table(["fault", "B", "hs.compare culprit", "per-layer diff", "DebugMode"], rows))
    n = score["cases"]
    print()
    print(table(
        ["method", "names the faulty module", "seconds for the suite"],
        [["hs.compare", f"{score['compare']}/{n}", f"{secs['compare']:.1f}"],
         ["per-layer output diff (first over threshold)", f"{score['diff']}/{n}", f"{secs['diff']:.1f}"],
         ["DebugMode check_hash_mismatches", f"{score['debugmode']}/{n}", f"{secs['debugmode']:.1f}"]],
    ))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("--only", default="", help="cost: only the models whose name holds this")
    p.add_argument("--record-dir", default="", help="cost: where records go (default /dev/shm)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.skip_cost:
        cost(args.rounds, args.only, args.record_dir)
        print()
    if not args.skip_faults:
        faults()


if __name__ == "__main__":
    main()
