"""``hookscope extract`` on a folder of images: corrupt files, bad input, SIGKILL + resume (byte for
byte), and a 2-process torchrun equal to one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope as hs
from helpers.common import files_of
from hookscope.cli import main
from hookscope.cli._modelspec import load_model
from hookscope.extraction._featstore import STATE_DIR

MODEL_PY = """
import os, time
import torch, torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        delay = float(os.environ.get("HOOKSCOPE_TEST_SLOW_FORWARD", "0"))
        if delay:  # test-only: makes a run slow enough to be killed half-way
            time.sleep(delay)
        return self.fc(self.pool(self.relu(self.conv(x))).flatten(1))


def make():
    return Net()
"""

SRC = str(Path(hs.__file__).resolve().parents[1])


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """11 small images in two class folders, plus ``cat/bad.png`` that is not an image."""
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path / "imgs"
    for i in range(11):
        d = root / ("cat" if i % 2 else "dog")
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (18 + i, 20, 3), dtype=np.uint8)).save(
            d / f"{i:02d}.png"
        )
    (tmp_path / "model.py").write_text(MODEL_PY)
    return root


def add_corrupt(root: Path) -> None:
    (root / "cat" / "bad.png").write_bytes(b"this is not a png")


def cli(tmp: Path, root: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"{tmp / 'model.py'}:make",
        "--data",
        str(root),
        "--layers",
        "conv,pool",
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--image-size",
        "16",
        "--num-workers",
        "0",
        *extra,
    ]


def in_process(args: list[str]) -> int:
    """Run the CLI in this process with one intra-op thread (as the subprocesses below)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["extract", *args])
    finally:
        torch.set_num_threads(threads)


def env(**extra: str) -> dict[str, str]:
    e = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    e.update(extra)
    return e


def test_folder_features_equal_a_direct_forward(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert in_process(cli(tmp_path, folder, out, "--pool", "avg", "--no-progress")) == 0
    assert "wrote 11 samples" in capsys.readouterr().out
    feats = hs.load_features(out)
    ds = hs.ImageFolder(folder, image_size=16)
    assert feats.index.tolist() == ds.files == sorted(ds.files)
    net = load_model(f"{tmp_path / 'model.py'}:make").eval()
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        conv = net.conv(x)
        pool = net.pool(torch.relu(conv))
    np.testing.assert_allclose(feats["conv"], conv.mean((2, 3)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(feats["pool"], pool.flatten(1).numpy(), rtol=1e-5, atol=1e-6)


def test_corrupt_image_raise_names_the_file_skip_records_it(folder, tmp_path, capsys):
    add_corrupt(folder)
    assert in_process(cli(tmp_path, folder, tmp_path / "r", "--no-progress")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        err.startswith("hookscope: error: sample 5 (cat/bad.png) could not be loaded")
        and "--on-error skip" in err
    )
    assert (
        in_process(cli(tmp_path, folder, tmp_path / "s", "--on-error", "skip", "--no-progress"))
        == 0
    )
    assert "1 skipped" in capsys.readouterr().out
    feats = hs.load_features(tmp_path / "s")
    assert feats.count == 12 and [s["id"] for s in feats.skipped] == ["cat/bad.png"]
    assert "cannot identify image file" in feats.skipped[0]["reason"]
    assert np.isnan(feats["conv"][5]).all() and not np.isnan(feats["conv"][feats.valid]).any()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "convv"], "no layer named 'convv'"),
        (["--data", "/nonexistent/dir"], "is not a directory"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--dtype", "int8"], "unsupported --dtype"),
    ],
)
def test_bad_input_is_one_line_exit_2(folder, tmp_path, capsys, args, message):
    base = cli(tmp_path, folder, tmp_path / "o", "--no-progress")
    for k in range(0, len(args), 2):
        if args[k] in base:
            base[base.index(args[k]) + 1] = args[k + 1]
        else:
            base += args[k : k + 2]
    assert in_process(base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _reference_with_a_skipped_file(folder, tmp_path):
    """Add a corrupt file to ``folder`` and extract it in process with ``--on-error skip``:
    the folder the other runs must write byte for byte."""
    add_corrupt(folder)
    ref = tmp_path / "ref"
    assert in_process(cli(tmp_path, folder, ref, "--on-error", "skip", "--no-progress")) == 0
    return ref


def test_sigkill_then_resume_is_byte_identical(folder, tmp_path):
    # skipped rows and the skipped list must survive the kill too
    ref = _reference_with_a_skipped_file(folder, tmp_path)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hookscope",
        "extract",
        *cli(tmp_path, folder, out, "--on-error", "skip"),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env(HOOKSCOPE_TEST_SLOW_FORWARD="0.5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    journal = out / STATE_DIR / "journal-0.json"
    deadline = time.monotonic() + 60
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            done = json.loads(journal.read_text())["done"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert 2 <= done < 6 and not (out / "manifest.json").exists()
    with pytest.raises(hs.IncompleteExtractionError):
        hs.load_features(out)
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    assert files_of(out) == files_of(ref)


@pytest.mark.distributed
def test_torchrun_two_processes_equal_one(folder, tmp_path):
    ref = _reference_with_a_skipped_file(folder, tmp_path)
    out = tmp_path / "dist"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "hookscope",
        "extract",
        *cli(tmp_path, folder, out, "--on-error", "skip", "--no-progress"),
    ]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("wrote 12 samples") == 1  # rank 0 reports
    assert files_of(out) == files_of(ref)


def test_a_folder_another_process_writes_is_refused_in_one_line(folder, tmp_path, capsys):
    from hookscope.extraction._lock import OutputLock

    out = tmp_path / "out"
    out.mkdir()
    lock = OutputLock(out)
    lock.acquire()
    try:
        assert in_process(cli(tmp_path, folder, out, "--no-progress")) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{out} is being written by pid {os.getpid()} " in err
    assert in_process(cli(tmp_path, folder, out, "--no-progress")) == 0
