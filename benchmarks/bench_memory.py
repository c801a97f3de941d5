"""hs.memory_profile wall time vs one plain training step, interleaved in one run.

Each round runs, in an order rotated every round: one plain training step (``model(x)``, the
loss, ``backward()``, gradients dropped); ``hs.memory_profile(model, x)`` (the same step under
saved-tensor hooks, forward hooks on every module and a dispatch mode for FLOPs and live bytes);
and, where it runs, PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) around the
same step. Medians (and minima) over the rounds, ratios to the plain step. Goal: memory_profile
<= 1.5x one plain step.

A second table times one training step with the modules of ``profile.plan(60% of the saved
bytes)`` checkpointed: by ``hs.apply_checkpointing`` (each recompute replays its call: buffers,
attributes, caches, random generators) and by hand (``torch.utils.checkpoint`` on the same
modules' forward, which updates BatchNorm statistics twice; GPT-2 called with ``use_cache=False``
in this table, which checkpointing by hand needs): the cost of the replay.

    .venv/bin/python benchmarks/bench_memory.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn as nn
import torchvision

import hookscope as hs
from _timing import samples, table

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))


def models() -> dict[str, tuple[nn.Module, tuple[object, ...], object]]:
    from tests.helpers.lm import tiny_gpt2
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    gpt = tiny_gpt2(n_layer=4, n_embd=128, n_head=4).train()
    ids = torch.randint(3, 40, (4, 64))
    vit = VisionTransformer(
        image_size=64, patch_size=8, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=256
    )
    return {
        "resnet18, 4x3x64x64": (torchvision.models.resnet18(), (torch.randn(4, 3, 64, 64),), None),
        "ViT 4 layers dim 128, 4x3x64x64": (vit, (torch.randn(4, 3, 64, 64),), None),
        "GPT-2 4 blocks dim 128, 4x64 tokens": (gpt, (ids,), lambda o: o.logits.float().mean()),
    }


def bench(name: str, model: nn.Module, inputs: tuple[object, ...], loss_fn, rounds: int):
    params = list(model.parameters())

    def plain() -> None:
        out = model(*inputs)
        (loss_fn(out) if loss_fn else out.float().sum()).backward()
        for p in params:
            p.grad = None

    contenders = {
        "plain step": plain,
        "hs.memory_profile": lambda: hs.memory_profile(model, *inputs, loss_fn=loss_fn),
    }
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        def tracked() -> None:
            mt = MemTracker()
            mt.track_external(model)
            with mt:
                plain()

        tracked()
        contenders["MemTracker"] = tracked
    except Exception as e:  # private API: may be absent or refuse this model
        print(f"MemTracker skipped for {name}: {type(e).__name__}: {e}")
    got = samples(contenders, rounds, warmup=2)
    med = {k: statistics.median(v) for k, v in got.items()}
    return [
        [
            name,
            k,
            f"{med[k] * 1e3:.1f}",
            f"{min(v) * 1e3:.1f}",
            f"{med[k] / med['plain step']:.2f}",
            f"{min(v) / min(got['plain step']):.2f}",
        ]
        for k, v in got.items()
    ]


def _by_hand(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """``torch.utils.checkpoint`` around the named modules' forward, as one would write it."""
    import functools

    from torch.utils.checkpoint import checkpoint

    modules = dict(model.named_modules())
    done = []
    for name in names:
        m = modules[name]
        fn = functools.partial(type(m).forward, m)
        m.forward = functools.partial(checkpoint, fn, use_reentrant=False)
        done.append(m)
    return done


def bench_apply(name: str, model: nn.Module, inputs: tuple[object, ...], loss_fn, rounds: int):
    params = list(model.parameters())
    prof = hs.memory_profile(model, *inputs, loss_fn=loss_fn)
    plan = prof.plan(int(prof.total_saved_bytes * 0.6))

    # by hand, GPT-2's recompute would append to its key/value cache again: all three without it
    kwargs = {"use_cache": False} if hasattr(model, "config") else {}

    def step() -> None:
        out = model(*inputs, **kwargs)
        (loss_fn(out) if loss_fn else out.float().sum()).backward()
        for p in params:
            p.grad = None

    def hookscope() -> None:
        with hs.apply_checkpointing(model, plan):
            step()

    def by_hand() -> None:
        wrapped = _by_hand(model, plan.modules)
        try:
            step()
        finally:
            for m in wrapped:
                del m.forward

    got = samples(
        {"plain step": step, "checkpoint by hand": by_hand, "hs.apply_checkpointing": hookscope},
        rounds,
        warmup=2,
    )
    base = statistics.median(got["checkpoint by hand"])
    return [
        [
            name,
            f"{len(plan.modules)}",
            k,
            f"{statistics.median(v) * 1e3:.1f}",
            f"{min(v) * 1e3:.1f}",
            f"{statistics.median(v) / base:.2f}",
        ]
        for k, v in got.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[list[object]] = []
    for name, (model, inputs, loss_fn) in models().items():
        rows += bench(name, model, inputs, loss_fn, args.rounds)
    print(
        table(
            ["model", "contender", "median (ms)", "min (ms)", "median / plain", "min / plain"],
            rows,
        )
    )
    rows = []
    for name, (model, inputs, loss_fn) in models().items():
        rows += bench_apply(name, model, inputs, loss_fn, args.rounds)
    print(
        table(
            ["model", "modules", "step", "median (ms)", "min (ms)", "median / by hand"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
