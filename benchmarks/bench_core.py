"""Overhead per hooked call: raw forward hooks vs hookscope ``capture`` vs TorchLens, and
``FeatureExtractor`` vs torchvision's FX feature extractor. Interleaved in one run.

    .venv/bin/python benchmarks/bench_core.py [--rounds N] [--only scope] [--against OLD/src]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings

import torch
import torch.nn as nn
import torchvision
from torchvision.models.feature_extraction import create_feature_extractor
from torchvision.models.resnet import Bottleneck, ResNet

sys.path.insert(0, os.path.dirname(__file__))
import hookscope as hs
from _timing import interleaved, table


def deep_mlp(depth: int = 100, width: int = 16) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class RawHooks:
    """The tutorial pattern: a dict filled by forward hooks (``acts[name] = out.detach()``, or
    ``out.detach().clone()`` with ``clone=True``, the seeds' recipe)."""

    def __init__(self, model: nn.Module, names: list[str], clone: bool = False) -> None:
        self.acts: dict[str, torch.Tensor] = {}
        mods = dict(model.named_modules())
        self.handles = []
        for n in names:
            if clone:

                def hook(m, i, o, n=n, acts=self.acts):
                    acts[n] = o.detach().clone()

            else:

                def hook(m, i, o, n=n, acts=self.acts):
                    acts[n] = o.detach()

            self.handles.append(mods[n].register_forward_hook(hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def torchlens_run(model: nn.Module, x: torch.Tensor):
    import torchlens as tl
    from torchlens.options import CaptureOptions

    # TorchLens logs every tensor operation (its default saves them all); it has no per-module
    # selection by a list of names, so this is its natural "capture everything" mode. Torch
    # functions are unwrapped after each call so the other contenders run on plain torch.
    return tl.trace(model, x, capture=CaptureOptions(unwrap_when_done=True))


def overhead_table(rounds: int) -> tuple[str, list[float]]:
    rows, ratios = [], []
    cases = [
        ("deep narrow MLP (100×Linear(16,16)+ReLU), batch 1", deep_mlp(), torch.randn(1, 16), 20),
        (
            "resnet50, 1×3×32×32",
            torchvision.models.resnet50(weights=None).eval(),
            torch.randn(1, 3, 32, 32),
            5,
        ),
        # The same 158 module calls with tiny kernels: hook cost does not depend on tensor size,
        # and on this machine the real resnet50's memory-bound kernels jitter by more than the
        # whole hook cost (±5 ms per forward vs ~0.3 ms of hooks), so this row isolates it.
        (
            "resnet50 structure, width_per_group=1, 1×3×32×32",
            ResNet(Bottleneck, [3, 4, 6, 3], width_per_group=1).eval(),
            torch.randn(1, 3, 32, 32),
            10,
        ),
    ]
    try:
        import torchlens  # noqa: F401

        have_tl = True
    except Exception:
        have_tl = False
    for label, model, x, inner in cases:
        names = list(hs.find(model, leaves=True))
        with hs.trace(model, names, quiet=True) as tr, torch.no_grad():
            model(x)
        n_calls = len(tr.events)
        raw = RawHooks(model, names)
        raw.remove()
        cap = hs.capture(model, names, keep="last", clone=False)
        cap.remove()

        def with_raw(m=model, x=x, n=names, inner=inner):
            h = RawHooks(m, n)
            try:
                for _ in range(inner):
                    m(x)
            finally:
                h.remove()

        def with_hookscope(m=model, x=x, n=names, inner=inner):
            with hs.capture(m, n, keep="last", clone=False):  # zero-copy, like the raw hooks
                for _ in range(inner):
                    m(x)

        def bare(m=model, x=x, inner=inner):
            for _ in range(inner):
                m(x)

        contenders = {"bare": bare, "raw hooks": with_raw, "hookscope capture": with_hookscope}
        with torch.no_grad():
            t_all = {
                stat: interleaved(contenders, rounds=rounds, stat=stat)
                for stat in ("min", "median")
            }
            # TorchLens wraps and unwraps torch's functions on every call, which disturbs whatever
            # runs next; it is ~1000x slower anyway, so it is timed in its own group against bare.
            if have_tl:
                tl_group = {"bare": bare, "TorchLens": lambda m=model, x=x: torchlens_run(m, x)}
                for stat in t_all:
                    t_tl = interleaved(tl_group, rounds=max(3, rounds // 3), stat=stat)
                    t_all[stat]["TorchLens"] = (
                        t_tl["TorchLens"] - t_tl["bare"] / inner + t_all[stat]["bare"] / inner
                    )
        for stat, t in t_all.items():
            per_fwd = {k: v / (1 if k == "TorchLens" else inner) for k, v in t.items()}
            per = {
                k: (v - per_fwd["bare"]) / n_calls * 1e6 for k, v in per_fwd.items() if k != "bare"
            }
            ratio = per["hookscope capture"] / per["raw hooks"]
            if stat == "min":
                ratios.append(ratio)
            rows.append(
                [
                    label,
                    stat,
                    n_calls,
                    f"{per_fwd['bare'] * 1e3:.2f}",
                    f"{per['raw hooks']:.2f}",
                    f"{per['hookscope capture']:.2f}",
                    f"{per['TorchLens']:.0f}" if "TorchLens" in per else "n/a",
                    f"{ratio:.2f}×",
                ]
            )
    head = [
        "model",
        "of rounds",
        "hooked calls/fwd",
        "bare fwd (ms)",
        "raw hooks µs/call",
        "hookscope µs/call",
        "TorchLens µs/call",
        "hookscope / raw",
    ]
    return table(head, rows), ratios


def load_against(src: str) -> object:
    """The hookscope package of another tree (``src``: its ``src`` folder, e.g. a ``git worktree``
    of an older main), imported under the name ``hookscope_against`` so both run in one process
    (hookscope's modules import each other relatively)."""
    import importlib
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="hookscope_against_")
    shutil.copytree(os.path.join(src, "hookscope"), os.path.join(tmp, "hookscope_against"))
    sys.path.insert(0, tmp)
    return importlib.import_module("hookscope_against")


def scope_table(rounds: int, against: object | None = None) -> tuple[str, list[float]]:
    """A scope as users write it, ``with hs.capture(model, layers): model(x)`` (open, one forward,
    close), against the same with raw ``register_forward_hook`` + ``remove()``; exactness like for
    like: hookscope's default (copies) against raw hooks storing ``out.detach().clone()``, the
    zero-copy mode (``clone=False``) against raw hooks storing ``out.detach()``. Figures are
    (run - bare forward) / hooked calls; ``steady`` rows register once and run 10 forwards."""
    model = deep_mlp(100, 64).eval()
    x = torch.randn(1, 64)
    names = list(hs.find(model, leaves=True))
    n_calls = len(names)

    def raw(clone: bool, inner: int):
        def run() -> None:
            h = RawHooks(model, names, clone=clone)  # includes dict(model.named_modules())
            try:
                for _ in range(inner):
                    model(x)
            finally:
                h.remove()

        return run

    def ours(clone: bool, inner: int, lib: object = hs):
        def run() -> None:
            with lib.capture(model, names, clone=clone, keep="last" if inner > 1 else "all"):  # type: ignore[attr-defined]
                for _ in range(inner):
                    model(x)

        return run

    def bare(inner: int):
        def run() -> None:
            for _ in range(inner):
                model(x)

        return run

    rows, ratios = [], []
    for how, inner in (("scope as written (1 forward)", 1), ("steady (10 forwards)", 10)):
        contenders = {
            "bare": bare(inner),
            "raw detach": raw(False, inner),
            "hs clone=False": ours(False, inner),
            "raw detach+clone": raw(True, inner),
            "hs default": ours(True, inner),
        }
        if against is not None:  # the other tree, interleaved in the same rounds
            contenders["other clone=False"] = ours(False, inner, against)
            contenders["other default"] = ours(True, inner, against)
        with torch.no_grad():
            for stat in ("min", "median"):
                t = interleaved(contenders, rounds=rounds, inner=max(1, 5 // inner), stat=stat)
                per = {k: (v - t["bare"]) / (inner * n_calls) * 1e6 for k, v in t.items()}
                pairs = [
                    ("zero-copy", "raw detach", "hs clone=False"),
                    ("exact (copies)", "raw detach+clone", "hs default"),
                ]
                if against is not None:
                    pairs += [
                        ("zero-copy, --against tree", "raw detach", "other clone=False"),
                        ("exact (copies), --against tree", "raw detach+clone", "other default"),
                    ]
                for mode, ref, ho in pairs:
                    r = per[ho] / per[ref]
                    if stat == "min" and "against" not in mode:
                        ratios.append(r)
                    rows.append(
                        [
                            how,
                            mode,
                            stat,
                            f"{t['bare'] / inner * 1e3:.2f}",
                            f"{per[ref]:.2f}",
                            f"{per[ho]:.2f}",
                            f"{r:.2f}×",
                        ]
                    )
    head = [
        "100×(Linear(64,64)+ReLU), batch 1, 200 leaves",
        "mode",
        "of rounds",
        "bare fwd (ms)",
        "raw µs/call",
        "hookscope µs/call",
        "hookscope / raw",
    ]
    return table(head, rows), ratios


def registration_table(rounds: int) -> str:
    """Cost of setting up and tearing down the hooks (once per scope)."""
    model = torchvision.models.resnet50(weights=None)
    names = list(hs.find(model, leaves=True))

    def raw():
        RawHooks(model, names).remove()

    def ours():
        hs.capture(model, names).remove()

    t = interleaved({"raw": raw, "hookscope": ours}, rounds=rounds, inner=10)
    return table(
        [
            "resnet50, 126 leaf layers",
            "raw register+remove (ms)",
            "hookscope capture open+close (ms)",
            "ratio",
        ],
        [
            [
                "setup + teardown",
                f"{t['raw'] * 1e3:.2f}",
                f"{t['hookscope'] * 1e3:.2f}",
                f"{t['hookscope'] / t['raw']:.2f}×",
            ]
        ],
    )


def extractor_table(rounds: int) -> str:
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(8, 3, 128, 128)
    rows = []
    for layers in (["layer2"], ["layer4", "avgpool"]):
        ours = hs.FeatureExtractor(model, layers)
        fx = create_feature_extractor(model, return_nodes=layers)
        with torch.no_grad():
            t = interleaved(
                {
                    "full forward": lambda: model(x),
                    "hookscope": lambda o=ours: o(x),
                    "FX": lambda f=fx: f(x),
                },
                rounds=rounds,
            )
        rows.append(
            [
                "+".join(layers),
                f"{t['full forward'] * 1e3:.1f}",
                f"{t['hookscope'] * 1e3:.1f}",
                f"{t['FX'] * 1e3:.1f}",
                f"{t['hookscope'] / t['FX']:.2f}×",
            ]
        )
    return table(
        [
            "layers (resnet50, 8×3×128×128)",
            "full fwd (ms)",
            "FeatureExtractor (ms)",
            "FX extractor (ms)",
            "hookscope / FX",
        ],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", choices=["scope"], help="run only this table")
    ap.add_argument(
        "--against",
        metavar="SRC",
        help="also time the scope table with the hookscope of another tree's src folder (e.g. a "
        "git worktree of an older main), interleaved in the same rounds",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # TorchLens prints deprecation/teaching warnings
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread, medians of {args.rounds} interleaved rounds\n"
    )
    against = load_against(args.against) if args.against else None
    if args.only == "scope":
        print(scope_table(args.rounds, against)[0])
        return
    text, _ = overhead_table(args.rounds)
    print(
        "Steady-state overhead per hooked call, (forward with hooks − bare forward) / hooked calls;"
    )
    print("hooks registered once per round, then several forwards (TorchLens: one traced forward).")
    print(
        "'min' is the best of the interleaved rounds (noise only adds time), 'median' the middle one:\n"
    )
    print(text)
    print(
        "\nA scope as users write it, and the cost of exactness like for like (hookscope's default "
        "keeps copies; clone=False is zero-copy):\n"
    )
    print(scope_table(args.rounds, against)[0])
    print("\nScope setup and teardown (hookscope also resolves the layer selection):\n")
    print(registration_table(args.rounds))
    print(
        "\nFeatureExtractor vs torchvision FX feature extractor (both stop after the last requested layer):\n"
    )
    print(extractor_table(max(5, args.rounds // 2)))


if __name__ == "__main__":
    main()
