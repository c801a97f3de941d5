"""The scripts in examples/ run, and say what the README says they do."""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.trainers import NOISE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.filterwarnings(*NOISE)  # the trainers' own notices


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_runs():
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "capture outputs and gradients" in r.stdout


@pytest.fixture
def trainers():
    yield _load("trainers")
    state = sys.modules.get("accelerate.state")
    if state is not None:  # Accelerate's process-wide state would refuse other tests' flags
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


def _small_data():
    import hookscope as hs

    return hs.make_demo_dataset(128)  # 8 micro-batches of 16: 4 optimizer steps


def test_trainers_example_lightning_logs_every_n_optimizer_steps(trainers, tmp_path):
    pytest.importorskip("lightning")
    path = trainers.lightning_run(_small_data(), tmp_path, steps=4, every=2)
    rows = list(csv.DictReader(path.open()))
    logged = [r for r in rows if r.get("hookscope/net.head.2/mean")]
    # optimizer steps 0 and 2 of 4 (accumulate_grad_batches=2 over 8 micro-batches)
    assert [int(r["step"]) for r in logged] == [0, 2]
    assert all(float(r["hookscope/params/net.head.2.weight/grad_norm"]) > 0 for r in logged)


def test_trainers_example_hf_logs_every_n_optimizer_steps(trainers, tmp_path):
    pytest.importorskip("transformers")
    logs = trainers.hf_run(_small_data(), tmp_path, steps=4, every=2)
    assert [h["step"] for h in logs] == [1, 3]  # the Trainer's global_step (1-based)
    assert all(h["hookscope/params/net.head.2.weight/grad_norm"] > 0 for h in logs)


def test_trainers_example_accelerate_logs_every_n_optimizer_steps(trainers, tmp_path):
    pytest.importorskip("accelerate")
    path = trainers.accelerate_run(_small_data(), tmp_path / "new", steps=4, every=2)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert [d["step"] for d in lines] == [0, 2]
    assert all(d["params"]["head.2.weight"]["grad_norm"] > 0 for d in lines)


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
def test_train_distributed_example_runs_on_two_gloo_ranks(tmp_path, mode):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    r = subprocess.run(
        [*launch, "2", str(EXAMPLES / "train_distributed.py"), mode],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    printed = [line for line in r.stdout.splitlines() if line[:1].isdigit()]
    assert [int(line.split()[0]) for line in printed] == [0, 5, 10, 15]  # rank 0 only, every=5
    lines = [json.loads(s) for s in (tmp_path / f"stats-{mode}.jsonl").read_text().splitlines()]
    # the sinks are written on rank 0 only, with what rank 0 printed
    assert [d["step"] for d in lines] == [0, 5, 10, 15]
    for line, d in zip(printed, lines):
        shown = ast.literal_eval(line.split(" ", 1)[1])  # a dict of rounded norms
        assert shown == {n: round(s["grad_norm"], 4) for n, s in d["params"].items()}
