"""profile.plan against PyTorch's own planner (SACEstimator + sac_milp) on the same model.

PyTorch's estimators need an accelerator: the roofline runtime model asserts
``torch.accelerator.is_available()`` (and aborts the process when it fails, inside a dispatch
mode). On a CPU-only machine this script replaces that check by ``lambda: True`` and pins the
roofline to a datasheet device (``--gpu-type``, default "NVIDIA H100"); runtimes are then that
device's estimates, memory is the same. Needs ``pulp`` and ``pwlf`` (both in
requirements-dev.txt).

For a budget it prints the modules and discard ratios ``sac_milp`` chooses, the bytes its model
says each frees (ratio x the module's activation memory from the estimator), what hookscope
predicts checkpointing the whole module frees and what is measured (saved_tensors_hooks), and
``profile.plan`` for the same drop.

    .venv/bin/python benchmarks/compare_sac.py [--model vit|resnet18] [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.saved_ref import reference_saved

import hookscope as hs
from hookscope.memory._plan import saved_after


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10), torch.randn(4, 3, 64, 64)
    from torchvision.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(
        image_size=64, patch_size=8, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=256
    )
    return vit, torch.randn(4, 3, 64, 64)


def loss_of(out: object) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return logits.float().sum()


def measured_saved(model: nn.Module, x: torch.Tensor) -> int:
    def step() -> None:
        loss_of(model(x)).backward()

    saved = reference_saved(model, step)
    model.zero_grad(set_to_none=True)
    return saved


def pytorch_stats(model_name: str, gpu_type: str) -> tuple[object, dict[str, object]]:
    """Module info (MemTracker + RuntimeEstimator + SACEstimator) under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    torch.accelerator.is_available = lambda: True  # see the docstring: CPU-only machine
    real, real_x = build(model_name)  # built for real (a ViT's initialisation reads values)
    fake_mode = FakeTensorMode()
    with FakeCopyMode(fake_mode):
        model = copy.deepcopy(real)
    x = fake_mode.from_tensor(real_x)
    with fake_mode:
        mt = MemTracker()
        mt.track_external(model)
        with mt:
            loss_of(model(x)).backward()
        model.zero_grad(set_to_none=True)
        rt = RuntimeEstimator(gpu_type=gpu_type)
        with rt("operator-level-cost-model"):
            loss_of(model(x)).backward()
        model.zero_grad(set_to_none=True)
        sac = SACEstimator(gpu_type=gpu_type)
        with sac("operator-level-cost-model"):
            loss = loss_of(model(x))
        loss.backward()
        # a module whose operations save nothing has an empty trade-off curve, which the curve
        # fit divides by: left out, it counts as a leaf (never checkpointed; it frees nothing)
        empty = [fqn for fqn, st in sac.sac_mod_stats.items() if sum(st.memory) == 0]
        for fqn in empty:
            del sac.sac_mod_stats[fqn]
        info = aggregate_stats(model, mt, rt, sac, torch.device("cpu"))
    order = info["mod_order"]["fw_pre_order"]
    twice = sorted({f for f in order if order.count(f) > 1})
    if twice:  # parse_module_info asserts one forward per module
        raise SystemExit(
            f"sac_milp cannot plan {model_name}: modules called more than once in forward "
            f"({', '.join(twice[:4])}{', ...' if len(twice) > 4 else ''}); its module graph "
            "assumes one call per module (parse_module_info raises AssertionError)"
        )
    graph = parse_module_info(info)
    return graph, {n["fqn"]: n for n in graph.nodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit", choices=["resnet18", "vit"])
    ap.add_argument("--fraction", type=float, default=0.5, help="of the activation memory to free")
    ap.add_argument("--gpu-type", default="NVIDIA H100")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import sac_milp

    graph, nodes = pytorch_stats(args.model, args.gpu_type)
    peak, _runtime = get_peak_memory_runtime_baseline(graph)
    acts = sum(n["act_fw_per_module"] for n in graph.nodes if n["fqn"].count(".") == 1)
    model, x = build(args.model)
    prof = hs.memory_profile(model, x, loss_fn=loss_of)
    want = int(prof.total_saved_bytes * args.fraction)
    budget_gib = (peak - want) / 2**30
    decisions, recompute_ms, peak_after = sac_milp(graph, memory_budget=budget_gib)
    root = type(model).__name__
    print(
        f"{args.model}: saved for backward {prof.total_saved_bytes:,} B (hookscope); PyTorch "
        f"baseline peak {peak:,} B, forward activations of the top modules {acts:,} B; asked "
        f"to free {want:,} B (sac_milp budget {budget_gib:.4f} GiB)"
    )
    print(f"sac_milp: {len(decisions)} module(s), recompute {recompute_ms} ms, peak {peak_after:,}")
    before = prof.total_saved_bytes
    for fqn, ratio in decisions.items():
        name = fqn[len(root) + 1 :] if fqn.startswith(root + ".") else fqn
        node = nodes[fqn]
        theirs = ratio * node["sac_memory"]
        ours = before - saved_after(prof, [name])
        with hs.apply_checkpointing(model, [name]):
            real = before - measured_saved(model, x)
        print(
            f"  {name:30} discard {ratio:.2f} of {node['sac_memory']:,} B: their model frees "
            f"{theirs:,.0f} B; whole module: hookscope predicts {ours:,} B, measured {real:,} B"
        )
    plan = prof.plan(before - want)
    ref = copy.deepcopy(model)
    with hs.apply_checkpointing(ref, plan):
        real = before - measured_saved(ref, x)
    print(f"hookscope plan: {plan}")
    print(f"  predicted drop {plan.predicted_drop:,} B, measured {real:,} B")


if __name__ == "__main__":
    main()
