"""Session 20's audit of hs.record and of reading records back: every failure inside the record's
block leaves no record (never a part of a run read as whole), a failed write leaves no files, a
record of a later format is refused, and spilled values are removed when a run raises.

References: the folder's listing (what a failed record leaves), a plain forward hook's values,
and a live ``hs.compare(a, b)`` of the same two runs."""

from __future__ import annotations

import copy
import errno
import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from hookscope.compare import _store
from hookscope.compare._record import _index_crc


def _loss(o: torch.Tensor) -> torch.Tensor:
    return o.float().pow(2).sum()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


class _Stops(nn.Module):
    """Its forward raises after its first layer ran (``fail``): a run cut short."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.a, self.b, self.exc, self.fail = nn.Linear(4, 4), nn.Linear(4, 4), exc, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.fail:
            raise self.exc
        return self.b(y)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- a run cut short inside the block, the exception caught there ---------------------------------
@pytest.mark.parametrize(
    "exc", [ValueError("midway"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
def test_a_forward_that_raised_inside_the_block_leaves_no_record(tmp_path, exc):
    # before: a record whose model output was "None" (the call never returned), compared with
    # the same model as error inf and culprit '<root>', B blamed for A's run that stopped
    net, x = _Stops(exc), torch.randn(2, 4)
    with (
        pytest.raises(hs.CompareError, match="the model's call (raised ValueError|never ended)"),
        hs.record(net, tmp_path / "rec"),
    ):
        try:
            net(x)
        except (ValueError, KeyboardInterrupt):
            pass
    assert _listing(tmp_path / "rec") == []
    net.fail = False  # the folder takes a record again
    with hs.record(net, tmp_path / "rec"):
        net(x)
    assert hs.compare(tmp_path / "rec", copy.deepcopy(net), x).culprit is None


def test_a_model_called_while_the_caller_handles_an_exception_is_recorded(tmp_path):
    # the check of a raised call tells the caller's exception from one the call raised
    net, x = _net(), torch.randn(3, 4)
    try:
        raise LookupError("the caller's")
    except LookupError:
        with hs.record(net, tmp_path / "rec"):
            _loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    assert (tmp_path / "rec" / "index.json").exists()


def test_a_backward_that_raised_inside_the_block_leaves_no_record(tmp_path):
    net, x = _net(), torch.randn(3, 4)

    def stop(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("midway through backward")

    with (
        pytest.raises(hs.CompareError, match="the backward raised RuntimeError"),
        hs.record(net, tmp_path / "rec"),
    ):
        out = net(x)
        out.register_hook(stop)
        try:
            _loss(out).backward()
        except RuntimeError:
            pass
    net.zero_grad(set_to_none=True)
    assert _listing(tmp_path / "rec") == []


class _Disk:
    """A spool's file on a disk that fills when ``full`` is set (ENOSPC from then on)."""

    full = False

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, data: Any) -> int:
        if _Disk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def test_a_write_that_failed_in_a_gradient_hook_leaves_no_record_though_caught(
    tmp_path, monkeypatch
):
    # the disk fills during backward, the error caught inside the block: before, the record was
    # kept without those gradients (read as "no gradient reached these calls")
    init = _store.Spool.__init__

    def spool_init(self: Any, folder: Path) -> None:
        init(self, folder)
        self._f = _Disk(self._f)

    monkeypatch.setattr(_store.Spool, "__init__", spool_init)
    monkeypatch.setattr(_Disk, "full", False)
    net, x = _net(), torch.randn(3, 4)
    with (
        pytest.raises(hs.CompareError, match=r"writing the output gradient .* failed \(OSError"),
        hs.record(net, tmp_path / "rec"),
    ):
        out = net(x)
        _Disk.full = True
        try:
            _loss(out).backward()
        except OSError:
            pass
    net.zero_grad(set_to_none=True)
    assert _listing(tmp_path / "rec") == []


def test_a_disk_that_fills_when_the_record_ends_leaves_no_files(tmp_path, monkeypatch):
    # before: values.bin, params.pt and a partial index.json.tmp stayed, and the next record
    # into the folder was refused as "already holds params.pt, a file the record writes"
    net, x = _net(), torch.randn(3, 4)
    write_text = Path.write_text

    def full(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if self.name == "index.json.tmp":
            write_text(self, text[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with (
        pytest.raises(
            hs.CompareError,
            match="writing the record into .* failed .*no record was kept: free space",
        ),
        hs.record(net, tmp_path / "rec"),
    ):
        _loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    assert _listing(tmp_path / "rec") == []
    monkeypatch.undo()
    with hs.record(net, tmp_path / "rec"):
        _loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    assert hs.compare(tmp_path / "rec", copy.deepcopy(net), x, loss_fn=_loss).culprit is None


def test_a_buffer_that_cannot_be_flushed_when_the_block_raised_leaves_no_values_bin(
    tmp_path, monkeypatch
):
    # the block raised and the last bytes cannot be written either (the disk is full): before,
    # values.bin stayed and the next record into the folder was refused as "being written"
    def no_flush(self: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    net, x = _Stops(ValueError("midway")), torch.randn(2, 4)
    real_close = _store.Spool.close

    def close(self: Any) -> None:
        f = self._f
        if f is not None:
            f.flush = lambda: no_flush(self)
            real = f.close

            def closing() -> None:
                real()
                raise OSError(errno.ENOSPC, "No space left on device")

            f.close = closing
        try:
            real_close(self)
        finally:
            self._f = None

    monkeypatch.setattr(_store.Spool, "close", close)
    with (
        pytest.raises(ValueError, match="midway"),  # the block's own error, not the flush's
        hs.record(net, tmp_path / "rec"),
    ):
        net(x)
    assert _listing(tmp_path / "rec") == []


# -- a record of a later format ----------------------------------------------------------------
def test_a_record_of_a_later_format_is_refused_naming_the_upgrade(tmp_path):
    # before: format 3 read as format 2, whatever its fields meant
    net, x = _net(), torch.randn(3, 4)
    with hs.record(net, tmp_path / "rec"):
        _loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    path = tmp_path / "rec" / "index.json"
    index = json.loads(path.read_text())
    index["version"] = 3
    index["checksums"]["index.json"] = _index_crc(index)
    path.write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="newer hookscope .*format 3.*upgrade hookscope"):
        hs.compare(tmp_path / "rec", copy.deepcopy(net), x, loss_fn=_loss)


# -- spilled values of a run that raised ---------------------------------------------------------
def _spills() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hookscope-compare-*")))


def test_the_spilled_values_of_a_run_that_raised_are_removed_at_once(tmp_path, monkeypatch):
    # before: a loss_fn that raised left the run's graph (its hooks holding the store) alive, and
    # the temporary folder stayed until the process ended
    net, x = _net(), torch.randn(3, 4)

    def bad(o: torch.Tensor) -> torch.Tensor:
        raise ValueError("a loss that fails")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (no other process's spills)
    before = _spills()
    with pytest.raises(ValueError, match="a loss that fails"):
        hs.compare(net, copy.deepcopy(net), x, loss_fn=bad, max_bytes=0)
    assert _spills() - before == set()
    report = hs.compare(net, copy.deepcopy(net), x, loss_fn=_loss, max_bytes=0)
    assert report.culprit is None
    del report
    assert _spills() - before == set()


# -- records of ranks ---------------------------------------------------------------------------
def _as_ranks(one: Path, folder: Path) -> None:
    """``folder`` made a record of 2 ranks from the one-process record ``one`` (each rank a copy
    of it, its index saying rank r of 2): what _load_ranks reads first, without launching ranks."""
    for r in range(2):
        dst = folder / f"rank{r}"
        dst.mkdir(parents=True)
        for name in ("values.bin", "params.pt"):
            (dst / name).write_bytes((one / name).read_bytes())
        index = json.loads((one / "index.json").read_text())
        index.update(rank=r, world=2, run="same")
        index["checksums"]["index.json"] = _index_crc(index)
        (dst / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("text", ["{garbage", "[1, 2]", "{}"])
def test_a_damaged_index_of_a_later_rank_is_refused_naming_its_folder(tmp_path, text):
    # before: a raw JSONDecodeError / AttributeError (rank0's index was checked, later ranks' not)
    net, x = _net(), torch.randn(3, 4)
    with hs.record(net, tmp_path / "one"):
        _loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    _as_ranks(tmp_path / "one", tmp_path / "ranks")
    (tmp_path / "ranks" / "rank1" / "index.json").write_text(text)
    with pytest.raises(hs.CompareError, match=r"rank1' is not a record written by hs.record"):
        hs.compare(tmp_path / "ranks", copy.deepcopy(net), torch.cat([x, x]), loss_fn=_loss)


# -- tensors on the meta device -----------------------------------------------------------------
class _MetaOut(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(3, device="meta"), x * 2


def test_a_meta_tensor_or_a_meta_model_is_refused_by_name_leaving_no_files(tmp_path):
    # before: a raw NotImplementedError "Cannot copy out of meta tensor" from pickling, and a
    # model on meta a raw RuntimeError from the autocast check ("unknown device type")
    net = nn.Sequential(nn.Linear(4, 4), _MetaOut())
    with (
        pytest.raises(hs.CompareError, match="output of module call 2 holds a tensor on the meta"),
        hs.record(net, tmp_path / "a"),
    ):
        net(torch.randn(2, 4))
    assert _listing(tmp_path / "a") == []
    meta = nn.Linear(4, 4, device="meta")
    with (
        pytest.raises(hs.CompareError, match="'weight', 'bias' are on the meta device"),
        hs.record(meta, tmp_path / "b"),
    ):
        meta(torch.randn(2, 4, device="meta"))
