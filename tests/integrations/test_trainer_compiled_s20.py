"""Audit s20: the Transformers ``Trainer`` with ``torch_compile=True`` calls Accelerate's
``torch.compile`` wrapper of the model, while callbacks are given the model itself. The
callback's Monitor hooked the model inside a compiled wrapper hookscope was not given: Dynamo
traced hookscope's hook code (a graph break at ``get_ident``, then its resume code recompiled
per layer up to Dynamo's recompile limit, torch's warning) and every step warned that the
wrapper's code may skip the hooks. The Monitor now watches the object the Trainer calls (routed,
the hooks opaque to Dynamo). Reference: the same steps in a plain eager loop with a Monitor."""

from __future__ import annotations

import copy
import logging
import math
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning:transformers.*",
    "ignore::UserWarning:accelerate.*",
    "ignore::ResourceWarning",
)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    dynamo.reset()
    yield
    dynamo.reset()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


class _Model(nn.Module):
    """The net as the Trainer calls it; no side effect in forward (a list it appends to would
    recompile the model's own code at every call)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class _Data(torch.utils.data.Dataset):
    """Samples, noting the order the Trainer reads them in."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.read = x, y, []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(i)
        return {"x": self.x[i], "labels": self.y[i]}


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_trainer_torch_compile_monitor_routed_exact_without_recompile_limit(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from hookscope.integrations.transformers import HookscopeTrainerCallback

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    base = nn.Sequential(*layers, nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    data = _Data(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    steps = 4
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    trainer = Trainer(model=_Model(copy.deepcopy(base)), args=args, train_dataset=data)
    cb = HookscopeTrainerCallback(trainer, every=1, alerts="off")
    trainer.add_callback(cb)
    log = _Log()
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(log)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        dynamo_log.removeHandler(log)
    assert not [m for m in log.lines if "recompile_limit" in m], log.lines
    texts = [str(w.message) for w in got if issubclass(w.category, hs.HookscopeWarning)]
    assert not [t for t in texts if "hookscope was not given" in t], texts
    assert [r.step for r in cb.records] == list(range(steps))

    # the reference: the same batches, in a plain eager loop with a Monitor
    order = data.read
    assert len(order) >= 4 * steps  # (the Trainer reads one batch ahead)
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, alerts="off") as mon:
        for k in range(steps):
            idx = order[4 * k : 4 * k + 4]
            F.cross_entropy(net(data.x[idx]), data.y[idx]).backward()
            opt.step()
            mon.step(opt)
            opt.zero_grad()
        want = {r.step: r for r in mon.records}
    for rec in cb.records:
        for layer in ("0", "5", "12"):
            for key, v in want[rec.step].layers[layer].items():
                got_v = rec.layers["net." + layer][key]
                assert math.isclose(got_v, v, rel_tol=2e-5, abs_tol=1e-6), (rec.step, layer, key)
