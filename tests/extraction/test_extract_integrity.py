"""``extract`` owns its output folder and never returns stale or mixed features: two processes on
one folder (one wins, its files equal its own uninterrupted run), a crashed owner leaves no stuck
lock, a distributed job holds one lock for all its ranks; a repeated or resumed run on other data,
another transform or another pool function is refused; samples that cannot be batched are named
or skipped."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_extract import Interrupting, Paced, TokenNet, reference
from torch.utils.data import Dataset, TensorDataset

import hookscope as hs
from helpers.common import files_of, one_thread
from helpers.dist import WORLD, launch
from hookscope.extraction._lock import LOCK, OutputLock

CTX = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def make(seed: int = 0, n: int = 11) -> tuple[TokenNet, TensorDataset]:
    torch.manual_seed(seed)
    net = TokenNet()
    g = torch.Generator().manual_seed(seed + 100)
    return net, TensorDataset(torch.randn(n, 3, 6, 6, generator=g))


# one folder, two writers ------------------------------------------------------------------------
JOBS = {"A": (0, ["conv", "proj"]), "B": (1, ["proj"])}  # a model and its layers per process


def _contender(name: str, out: str, start, results) -> None:
    torch.set_num_threads(1)
    seed, layers = JOBS[name]
    net, data = make(seed)
    start.wait()
    try:
        hs.extract(net, Paced(data, 0.03), layers, out, batch_size=2, pool="avg", progress=False)
        results.put((name, "ok"))
    except hs.ExtractError as e:
        results.put((name, str(e)))
    except BaseException as e:  # anything else is a failure of the test
        results.put((name, f"UNEXPECTED {type(e).__name__}: {e}"))


def test_two_processes_on_one_folder_one_wins_with_its_own_files(tmp_path):
    refs = {}
    with one_thread():
        for name, (seed, layers) in JOBS.items():
            net, data = make(seed)
            ref = tmp_path / f"ref-{name}"
            hs.extract(net, data, layers, ref, batch_size=2, pool="avg", progress=False)
            refs[name] = files_of(ref)
    for round_ in range(3):
        out = tmp_path / f"shared-{round_}"
        start, results = CTX.Barrier(2), CTX.Queue()
        procs = [
            CTX.Process(target=_contender, args=(name, str(out), start, results)) for name in JOBS
        ]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        winners = [n for n, r in got.items() if r == "ok"]
        assert len(winners) == 1, got
        (loser,) = set(JOBS) - set(winners)
        msg = got[loser]
        assert "\n" not in msg and str(out) in msg, msg
        assert "is being written by pid" in msg and "cannot share an output folder" in msg, msg
        feats = hs.load_features(out)  # the winner's run, complete
        assert feats.layers == JOBS[winners[0]][1]
        assert files_of(out) == refs[winners[0]]
        assert not (out / LOCK).exists()


def _hold(path: str, ready, release) -> None:
    lock = OutputLock(__import__("pathlib").Path(path))
    lock.acquire()
    ready.set()
    release.wait(60)


def test_a_running_owner_refuses_others_and_a_killed_one_leaves_no_stuck_lock(tmp_path):
    net, data = make()
    out = tmp_path / "out"
    out.mkdir()
    ready, release = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold, args=(str(out), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        t0 = time.monotonic()
        with pytest.raises(hs.ExtractError, match=rf"is being written by pid {holder.pid} "):
            hs.extract(net, data, "conv", out, batch_size=4, progress=False)
        assert time.monotonic() - t0 < 10  # at once, not after a wait
        with pytest.raises(
            hs.IncompleteExtractionError, match=rf"being written by pid {holder.pid}"
        ):
            hs.load_features(out)
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the lock; its file stays behind
        holder.join(30)
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join()
    assert (out / LOCK).exists()
    feats = hs.extract(net, data, "conv", out, batch_size=4, progress=False)
    want = reference(net, data.tensors[0])["conv"].numpy()
    np.testing.assert_allclose(feats["conv"], want, rtol=1e-5, atol=1e-6)
    assert not (out / LOCK).exists()


def _slow_run(out: str) -> None:
    torch.set_num_threads(1)
    net, data = make(n=40)
    hs.extract(net, Paced(data, 0.05), "conv", out, batch_size=2, num_workers=2, progress=False)


def test_an_owner_killed_with_loader_workers_frees_the_folder_at_once(tmp_path):
    """Forked DataLoader workers inherit the lock's descriptor: the lock must not outlive an
    owner killed with SIGKILL (the workers drop their copy when they start; PyTorch also kills
    them with their parent on Linux, so this guards other platforms and start methods)."""
    out = tmp_path / "out"
    owner = CTX.Process(target=_slow_run, args=(str(out),))
    owner.start()
    journal = out / ".hookscope-extract" / "journal-0.json"
    deadline = time.monotonic() + 60
    while not journal.exists() and time.monotonic() < deadline and owner.is_alive():
        time.sleep(0.02)
    assert journal.exists() and owner.is_alive()
    net, data = make(n=40)
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(30)
    with one_thread():
        feats = hs.extract(net, data, "conv", out, batch_size=2, progress=False)  # at once
    want = reference(net, data.tensors[0])["conv"].numpy()
    np.testing.assert_allclose(feats["conv"], want, rtol=1e-5, atol=1e-6)


def _job_ranks(rank: int, tmp: str) -> None:
    net, data = make()
    for folder in ("held", "free"):
        try:
            hs.extract(net, data, "conv", os.path.join(tmp, folder), batch_size=2, progress=False)
            what = "ok"
        except hs.ExtractError as e:
            what = str(e)
        with open(os.path.join(tmp, f"{folder}-{rank}.txt"), "w") as f:
            f.write(what)


@pytest.mark.distributed
def test_a_distributed_job_holds_one_lock_for_all_its_ranks(tmp_path):
    """The ranks of one job write one folder together (one lock, rank 0's, for the job); a
    folder another process owns makes every rank fail with the message, none waits forever."""
    held = tmp_path / "held"
    held.mkdir()
    lock = OutputLock(held)
    lock.acquire()
    try:
        launch(_job_ranks, str(tmp_path), timeout=240)
    finally:
        lock.release()
    for rank in range(WORLD):
        msg = (tmp_path / f"held-{rank}.txt").read_text()
        assert f"{held} is being written by pid {os.getpid()} " in msg, msg
        assert (tmp_path / f"free-{rank}.txt").read_text() == "ok"
    net, data = make()
    want = reference(net, data.tensors[0])["conv"].numpy()
    np.testing.assert_allclose(
        hs.load_features(tmp_path / "free")["conv"], want, rtol=1e-5, atol=1e-6
    )
    assert not (tmp_path / "free" / LOCK).exists()


# other data, transform or pool function ---------------------------------------------------------
def test_a_repeated_run_on_other_data_is_refused(tmp_path):
    net, a = make(0)
    _, b = make(1)
    hs.extract(net, a, ["conv"], tmp_path, pool="avg", batch_size=4, progress=False)
    with pytest.raises(hs.ExtractError, match=r"data differ.*resume=False"):
        hs.extract(net, b, ["conv"], tmp_path, pool="avg", batch_size=4, progress=False)
    with pytest.raises(hs.ExtractError, match=r"data differ.*resume=False"):
        hs.extract(
            net, b, ["conv"], tmp_path, pool="avg", batch_size=4, progress=False, verify="sample"
        )
    # the same data again: the finished run is returned; resume=False recomputes on B
    again = hs.extract(net, a, ["conv"], tmp_path, pool="avg", batch_size=4, progress=False)
    want_a = reference(net, a.tensors[0])["conv"].mean((2, 3)).numpy()
    np.testing.assert_allclose(again["conv"], want_a, rtol=1e-5, atol=1e-6)
    redo = hs.extract(
        net, b, ["conv"], tmp_path, pool="avg", batch_size=4, progress=False, resume=False
    )
    want_b = reference(net, b.tensors[0])["conv"].mean((2, 3)).numpy()
    np.testing.assert_allclose(redo["conv"], want_b, rtol=1e-5, atol=1e-6)


def test_one_changed_sample_is_caught_when_every_finished_batch_is_checked(tmp_path):
    net, a = make(0)
    hs.extract(net, a, ["conv"], tmp_path, batch_size=2, progress=False)
    x = a.tensors[0].clone()
    x[5] += 1e-3  # batch 2 (rows 4 .. 5)
    with pytest.raises(hs.ExtractError, match=r"batch 2, rows 4 \.\. 5"):
        hs.extract(net, TensorDataset(x), ["conv"], tmp_path, batch_size=2, progress=False)


class Transformed(Dataset):
    def __init__(self, base: TensorDataset, scale: float) -> None:
        self.base, self.scale = base, scale

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        return self.base[i][0] * self.scale


def test_a_changed_transform_is_refused(tmp_path):
    net, a = make(0)
    hs.extract(net, Transformed(a, 1.0), "head", tmp_path, batch_size=4, progress=False)
    with pytest.raises(hs.ExtractError, match="data differ"):
        hs.extract(net, Transformed(a, 2.0), "head", tmp_path, batch_size=4, progress=False)


def test_an_interrupted_run_resumed_on_other_data_does_not_mix(tmp_path):
    net, a = make(0)
    _, b = make(1)
    full = tmp_path / "full"
    hs.extract(net, a, ["conv"], full, batch_size=2, progress=False)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        hs.extract(net, Interrupting(a, 7), ["conv"], part, batch_size=2, progress=False)
    with pytest.raises(hs.ExtractError, match=r"data differ.*batch 0"):
        hs.extract(net, b, ["conv"], part, batch_size=2, progress=False)
    with pytest.raises(hs.IncompleteExtractionError):
        hs.load_features(part)  # nothing of B was written
    hs.extract(net, a, ["conv"], part, batch_size=2, progress=False)  # resumed on A: as one run
    assert files_of(part) == files_of(full)


def scaled(k: float):
    return lambda t: t.flatten(1) * k


def test_a_changed_pool_function_is_refused(tmp_path):
    net, a = make(0)
    hs.extract(net, a, "head", tmp_path, pool=scaled(1.0), batch_size=4, progress=False)
    # the same code and closure values (a new function object): the finished run is returned
    hs.extract(net, a, "head", tmp_path, pool=scaled(1.0), batch_size=4, progress=False)
    with pytest.raises(hs.ExtractError, match="another run"):  # another closure value
        hs.extract(net, a, "head", tmp_path, pool=scaled(2.0), batch_size=4, progress=False)

    def norms(t):
        return t.flatten(1).norm(dim=1, keepdim=True)

    first = norms

    def norms(t):
        return t.flatten(1).abs().sum(dim=1, keepdim=True)

    other = tmp_path / "fn"
    hs.extract(net, a, "head", other, pool=first, batch_size=4, progress=False)
    with pytest.raises(hs.ExtractError, match="another run"):
        hs.extract(net, a, "head", other, pool=norms, batch_size=4, progress=False)


# samples that cannot be batched -----------------------------------------------------------------
class Odd(Dataset):
    """Sample ``wrong`` has the wrong shape, sample ``none`` is ``None``."""

    def __init__(self, base: TensorDataset, wrong: int | None = 5, none: int = 8) -> None:
        self.base, self.wrong, self.none = base, wrong, none

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x = self.base[i][0]
        return x[:, :5] if i == self.wrong else (None if i == self.none else x)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_of_the_wrong_shape_or_none_is_named_or_skipped(tmp_path, workers):
    net, a = make(0)
    kw = dict(batch_size=4, num_workers=workers, progress=False)
    with pytest.raises(
        hs.ExtractError,
        match=r"sample 5 cannot be batched: it is Tensor\(3, 5, 6\) float32 where the samples "
        r"are Tensor\(3, 6, 6\) float32.*on_error='skip'",
    ):
        hs.extract(net, Odd(a), "head", tmp_path / "r", **kw)
    with pytest.raises(hs.ExtractError, match=r"sample 8 cannot be batched: it is None"):
        hs.extract(net, Odd(a, wrong=None), "head", tmp_path / "n", **kw)
    with pytest.warns(hs.HookscopeWarning, match=r"2 of 11 samples were skipped.*sample 5"):
        feats = hs.extract(net, Odd(a), "head", tmp_path / "s", on_error="skip", **kw)
    assert [s["row"] for s in feats.skipped] == [5, 8]
    assert feats.valid.tolist() == [i not in (5, 8) for i in range(11)]
    want = reference(net, a.tensors[0])["head"].numpy()
    np.testing.assert_allclose(feats["head"][feats.valid], want[feats.valid], rtol=1e-5, atol=1e-6)
    assert np.isnan(feats["head"][~feats.valid]).all()


def _in_thread(out, name, start, results) -> None:
    seed, layers = JOBS[name]
    net, data = make(seed)
    start.wait()
    try:
        hs.extract(net, Paced(data, 0.02), layers, out, batch_size=2, progress=False)
        results[name] = "ok"
    except hs.ExtractError as e:
        results[name] = str(e)


def test_two_threads_on_one_folder_one_wins(tmp_path):
    """The lock is held by an open file, not by a process: a second thread is refused too."""
    import threading

    start, results = threading.Barrier(2), {}
    threads = [
        threading.Thread(target=_in_thread, args=(tmp_path, name, start, results)) for name in JOBS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results.values()).count("ok") == 1, results
    (msg,) = [m for m in results.values() if m != "ok"]
    assert "is being written by pid" in msg
    (winner,) = [n for n, m in results.items() if m == "ok"]
    assert hs.load_features(tmp_path).layers == JOBS[winner][1]


def test_internal_functions_take_few_parameters():
    """Values that travel together go in a job object (Source, Options, Job), not in long
    positional lists."""
    import inspect

    from hookscope import extraction

    too_many = []
    for mod_name in ("_data", "_digest", "_extract", "_featstore", "_forward", "_job", "_lock"):
        mod = __import__(f"{extraction.__name__}.{mod_name}", fromlist=["_"])
        for name, obj in vars(mod).items():
            if getattr(obj, "__module__", None) != mod.__name__ or name == "extract":
                continue
            funcs = [obj] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                funcs = [f for f in vars(obj).values() if inspect.isfunction(f)]
            for f in funcs:
                params = [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]
                if len(params) > 7:
                    too_many.append(f"{mod_name}.{f.__qualname__}({len(params)})")
    assert too_many == []


def test_the_fingerprint_of_code_is_the_same_in_every_process():
    """A forward using a set of strings compiles to a frozenset constant whose repr follows the
    per-process string hash seed; the run's fingerprint must not (a resume would be refused)."""
    import subprocess
    import sys

    code = (
        "import torch.nn as nn\n"
        "from hookscope.extraction._digest import callable_identity\n"
        "def pool(t):\n"
        "    return t if t.dtype in {'float32', 'float16', 'bfloat16', 'int8', 'uint8'} else t\n"
        "print(callable_identity(pool))\n"
    )
    src = os.path.dirname(os.path.dirname(hs.__file__))
    got = {
        subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=src),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(got) == 1, got


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.temperature, self.table = nn.Linear(64, 32), 1.0, None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.table is None:  # built lazily on the first call
            self.table = torch.linspace(1.0, 2.0, x.shape[-1])
        return self.fc(x * self.table) / self.temperature


def _loader(x: torch.Tensor) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def test_a_model_changed_anywhere_is_not_another_run_s_features(tmp_path):
    """One unit ablated (a row of weights zeroed) after a finished extraction: the fingerprint
    sampled ~64 values per tensor, so the same folder returned the old features; a changed plain
    attribute the forward reads (a temperature) too. Both are refused now, naming what differs."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    m = _Tempered().eval()
    hs.extract(m, _loader(x), ["fc"], tmp_path / "a", progress=False)
    with torch.no_grad():
        m.fc.weight[3].zero_()
    with pytest.raises(hs.ExtractError, match="model weights differ"):
        hs.extract(m, _loader(x), ["fc"], tmp_path / "a", progress=False)
    m2 = _Tempered().eval()
    hs.extract(m2, _loader(x), ["fc"], tmp_path / "b", progress=False)
    m2.temperature = 2.0
    with pytest.raises(hs.ExtractError, match="model attributes"):
        hs.extract(m2, _loader(x), ["fc"], tmp_path / "b", progress=False)


def test_extraction_calls_the_model_as_a_hand_loop_does_and_leaves_normal_tensors(tmp_path):
    """A probe forward on one sample ran before the batches (4 calls for 2 batches: a counter
    the forward reads made every feature differ from a hand loop's), under inference_mode: a
    table the model builds lazily was an inference tensor, failing the next training step."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    m, ref_m = _Tempered().eval(), _Tempered().eval()
    feats = hs.extract(m, _loader(x), ["fc"], tmp_path, progress=False)
    with torch.no_grad():
        ref = torch.cat([ref_m.fc(b * torch.linspace(1.0, 2.0, 64)) for (b,) in _loader(x)])
    np.testing.assert_array_equal(np.asarray(feats["fc"]), ref.numpy())
    assert m.calls == 0 and m.table is None  # the model's plain state: left as found
    m.train()
    m(torch.randn(2, 64, requires_grad=True)).sum().backward()  # a training step runs


def test_starting_over_removes_the_earlier_run_s_layer_files(tmp_path):
    """resume=False with other layers: the earlier run's file of a layer this run does not
    extract stayed, holding the earlier data's features beside the new manifest."""
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(8, 8)
    hs.extract(net, _loader(x), ["0", "2"], tmp_path, progress=False)
    assert (tmp_path / "0.npy").exists()
    hs.extract(net, _loader(x + 1), ["2"], tmp_path, progress=False, resume=False)
    assert not (tmp_path / "0.npy").exists() and (tmp_path / "2.npy").exists()


class _Tracks(nn.Module):
    """Keeps a float statistic of what it saw (an amax tracker), which its features ignore."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.peak = nn.Linear(8, 4), 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.peak = max(self.peak, float(x.abs().max()))
        return self.fc(x)


class _FailsFrom(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, bad: int | None) -> None:
        self.x, self.bad = x, bad

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.bad is not None and i >= self.bad:
            raise RuntimeError("interrupted")
        return self.x[i]


def test_a_run_that_changed_a_float_attribute_is_resumed_and_the_model_left_as_found(tmp_path):
    """The float attributes are in the fingerprint (a temperature): an interrupted run that
    changed one (a tracker) made its own resume read as another run's. The model's plain state is
    put back when extraction ends (it evolves over the batches as in a hand loop)."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    m = _Tracks().eval()
    with pytest.raises(hs.ExtractError, match="interrupted"):
        hs.extract(m, _FailsFrom(x, 8), "fc", tmp_path, batch_size=4, progress=False)
    assert m.peak == 0.0
    feats = hs.extract(m, _FailsFrom(x, None), "fc", tmp_path, batch_size=4, progress=False)
    with torch.no_grad():
        np.testing.assert_array_equal(np.asarray(feats["fc"]), m.fc(x).numpy())
    assert m.peak == 0.0
