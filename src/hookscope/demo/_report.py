"""What goes in the report of ``hookscope demo`` and ``hookscope report``: each section computed by
hookscope's own tools (summary, capture + feature maps, Grad-CAM, Monitor, find_nonfinite).

A section that cannot be made (a missing optional dependency, a model it does not apply to) is
kept with a note saying why, so the rest of the report still renders.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core._capture import capture
from ._html import Figure, Raw, Report, Section

__all__ = ["ReportFacts", "build_demo_report", "build_model_report"]


@dataclass
class ReportFacts:
    """The numbers behind a report, for the CLI's text summary and for tests."""

    model: str = ""
    params: int | None = None
    lines: list[str] = field(default_factory=list)
    correct: int | None = None
    shown: int = 0
    cam_in_box: int | None = None
    cam_layer: str = ""
    predictions: list[str] = field(default_factory=list)
    flow_alerts: list[str] = field(default_factory=list)
    nonfinite: str = ""
    nonfinite_layer: str = ""
    unavailable: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _guard(facts: ReportFacts, section: Section, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn``; on failure, replace the section's content with a note naming the error."""
    t0 = time.perf_counter()
    try:
        fn()
    except ImportError as e:
        section.blocks.clear()
        section.note = f"not available: {e} (pip install 'hookscope[viz]')"
        facts.unavailable[what] = str(e)
    except Exception as e:
        section.blocks.clear()
        section.note = f"not available: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        facts.unavailable[what] = f"{type(e).__name__}: {e}"
    facts.seconds[what] = time.perf_counter() - t0


def _logits(out: Any) -> torch.Tensor | None:
    from ..core._nested import first_tensor

    t = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    t = t if isinstance(t, torch.Tensor) else first_tensor(out)
    return t if isinstance(t, torch.Tensor) and t.ndim == 2 else None


def _class_name(classes: Any, k: int) -> str:
    if classes is not None and 0 <= k < len(classes):
        return str(classes[k])
    return f"class {k}"


def spatial_children(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the model's top-level children whose output is a ``(B, C, H, W)`` map larger than
    1×1 (so not a global pooling), in definition order."""
    names = [n for n, _ in model.named_children()]
    if not names:
        return []
    with torch.no_grad(), capture(model, names) as cap:
        model(x)
        missing = set(cap.missing)
    ran = [n for n in names if n not in missing]
    return [
        n
        for n in ran
        if isinstance(cap[n], torch.Tensor) and cap[n].ndim == 4 and cap[n].shape[-2:].numel() > 1
    ]


# -- sections -----------------------------------------------------------------------------------
def summary_section(report: Report, facts: ReportFacts, model: nn.Module, x1: torch.Tensor) -> None:
    s = report.section(
        "Summary",
        "One forward pass, one row per module call: shapes, parameters, FLOPs counted at the "
        "dispatcher, time and output memory (hs.summary).",
    )

    def run() -> None:
        from ..summarization._summary import summary

        summ = summary(model, x1)
        facts.params = summ.totals.params
        s.raw(Raw(summ._repr_html_()))

    _guard(facts, s, "summary", run)


def maps_section(
    report: Report,
    facts: ReportFacts,
    model: nn.Module,
    x1: torch.Tensor,
    shown: Any,
    layers: list[str],
) -> None:
    s = report.section(
        "Feature maps",
        "What each stage sees in one input image: the 16 strongest channels of each stage's output "
        "(by mean square), each scaled to its own range (hs.capture + hs.feature_maps).",
    )

    def run() -> None:
        from ..viz._pictures import feature_maps

        if not layers:
            s.note = "no top-level layer of this model outputs a (B, C, H, W) map; nothing to draw"
            return
        with torch.no_grad(), capture(model, layers) as cap:
            model(x1)
        figs = [
            Figure(shown, "input image", scale=max(1, 192 // max(1, shown.shape[0])), width=240)
        ]
        for name in layers:
            a = cap[name]
            fig = feature_maps(a[0], max_channels=16)
            figs.append(
                Figure(fig, f"{name}: {a.shape[1]} channels, {a.shape[2]}×{a.shape[3]}", width=300)
            )
        s.figures(figs, columns=min(len(figs), 4))

    _guard(facts, s, "feature maps", run)


def _draw_box(img: Any, box: list[int], scale: int, peak: tuple[int, int] | None) -> Any:
    from PIL import ImageDraw

    d = ImageDraw.Draw(img)
    x0, y0, x1, y1 = box
    d.rectangle(
        [x0 * scale, y0 * scale, (x1 + 1) * scale - 1, (y1 + 1) * scale - 1],
        outline=(255, 255, 255),
        width=2,
    )
    if peak is not None:
        px, py = (peak[0] + 0.5) * scale, (peak[1] + 0.5) * scale
        d.line([px - 6, py, px + 6, py], fill=(255, 255, 255), width=2)
        d.line([px, py - 6, px, py + 6], fill=(255, 255, 255), width=2)
    return img


def cam_section(
    report: Report,
    facts: ReportFacts,
    model: nn.Module,
    layer: str,
    x: torch.Tensor,
    shown: torch.Tensor,
    *,
    classes: Any = None,
    labels: torch.Tensor | None = None,
    boxes: torch.Tensor | None = None,
) -> None:
    intro = (
        f"Where the model looks: Grad-CAM at layer {layer!r} for the predicted class, over the input "
        "(red = strong evidence; hs.GradCAM + hs.overlay)."
    )
    if boxes is not None:
        intro += (
            " The white box is the shape's true bounding box; the cross marks the map's maximum."
        )
    s = report.section("Grad-CAM", intro)

    def run() -> None:
        from PIL import Image

        from ..cam._methods import GradCAM
        from ..viz._pictures import overlay

        facts.cam_layer = layer
        with torch.no_grad():
            logits = _logits(model(x))
        cams = GradCAM(model, layer)(x)
        probs = logits.softmax(1) if logits is not None else None
        preds = probs.argmax(1) if probs is not None else None
        h, w = cams.shape[-2:]
        peaks = cams.flatten(1).argmax(1)
        scale = max(1, 192 // max(h, w))
        figs, correct, inside = [], 0, 0
        for i in range(x.shape[0]):
            img = overlay(shown[i], cams[i], alpha=0.45)
            pil = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
            pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
            peak = (int(peaks[i] % w), int(peaks[i] // w))
            cap, tone = [], ""
            if preds is not None and probs is not None:
                k = int(preds[i])
                pred_text = f"predicted {_class_name(classes, k)} ({float(probs[i, k]):.0%})"
                facts.predictions.append(pred_text.removeprefix("predicted "))
                if labels is not None:
                    ok = k == int(labels[i])
                    correct += ok
                    tone = "good" if ok else "bad"
                    cap.append(f"true {_class_name(classes, int(labels[i]))} · {pred_text}")
                else:
                    cap.append(pred_text)
            if boxes is not None:
                b = [int(v) for v in boxes[i]]
                hit = b[0] <= peak[0] <= b[2] and b[1] <= peak[1] <= b[3]
                inside += hit and (
                    labels is None or preds is None or int(preds[i]) == int(labels[i])
                )
                pil = _draw_box(pil, b, scale, peak)
                cap.append("peak inside the box" if hit else "peak OUTSIDE the box")
                if not hit:
                    tone = "bad"
            figs.append(Figure(pil, " · ".join(cap), tone=tone, width=min(pil.width, 224)))
        s.figures(figs)
        facts.shown = x.shape[0]
        if labels is not None and preds is not None:
            facts.correct = correct
        if boxes is not None:
            facts.cam_in_box = inside

    _guard(facts, s, "grad-cam", run)


def flow_section(
    report: Report, facts: ReportFacts, *, steps: int = 20, batch: int = 16, seed: int = 0
) -> None:
    from ._data import make_demo_dataset
    from ._model import DemoNet

    s = report.section(
        "Gradient flow",
        f"A fresh, untrained demo network trained for {steps} steps (batch {batch}, AdamW) under "
        "hs.Monitor: per-parameter gradient norms, mean over the steps (dark) and maximum (light), "
        "in model order on a log scale. Healthy flow keeps the bars within a few orders of "
        "magnitude from the first layer to the last.",
    )

    def run() -> None:
        from ..monitor._monitor import Monitor

        gen_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            net = DemoNet().train()
        finally:
            torch.random.set_rng_state(gen_state)
        data = make_demo_dataset(steps * batch, seed=10_000 + seed)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
        losses = []
        with Monitor(net, alerts="off") as mon:
            for i in range(steps):
                xb = data.images[i * batch : (i + 1) * batch]
                yb = data.labels[i * batch : (i + 1) * batch]
                loss = F.cross_entropy(net(xb), yb)
                loss.backward()
                opt.step()
                mon.step(opt)
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
            records = list(mon.records)
            fig = mon.plot()
        s.figures(
            [
                Figure(
                    fig, f"parameter gradient norms over {len(records)} monitored steps", width=820
                )
            ],
            columns=1,
        )
        alerts = [a for r in records for a in r.alerts]
        seen: dict[tuple[str, str], Any] = {}
        for a in alerts:
            seen.setdefault((a.kind, a.layer), a)
        facts.flow_alerts = [f"{k}: {a.message}" for (k, _), a in seen.items()]
        s.text(f"Loss went from {losses[0]:.3f} to {losses[-1]:.3f} in {steps} steps.")
        if seen:
            s.table(
                ["alert", "layer", "first step", "message"],
                [[a.kind, a.layer, a.step, a.message] for a in list(seen.values())[:12]],
            )
        else:
            s.text(
                "The monitor raised no alert: no vanishing, exploding, dead or saturated layer.",
                kind="ok",
            )

    _guard(facts, s, "gradient flow", run)


def break_demo_model(model: nn.Module) -> tuple[nn.Module, str]:
    """A copy of the demo model with one corrupted batch-norm statistic, and what was done."""
    broken = copy.deepcopy(model)
    bn = broken.stage2[4]  # the second BatchNorm2d of stage2
    with torch.no_grad():
        bn.running_var[5] = -1.0
    return (
        broken,
        "broken = copy.deepcopy(model)\nbroken.stage2[4].running_var[5] = -1.0   # a corrupted statistic",
    )


def nonfinite_section(
    report: Report,
    facts: ReportFacts,
    model: nn.Module,
    x1: torch.Tensor,
    *,
    broken: tuple[nn.Module, str] | None = None,
) -> None:
    intro = (
        "hs.find_nonfinite runs one forward and one backward pass with every module watched and names "
        "the first layer that produced a NaN or Inf (the producer, not the layers that pass it on)."
    )
    s = report.section("NaN origin", intro)

    def run() -> None:
        from ..monitor._nonfinite import find_nonfinite

        intact = find_nonfinite(model, x1)
        if intact is None:
            s.text(
                "This model: every activation and gradient stayed finite on the input.", kind="ok"
            )
        else:
            s.text(f"This model: {intact}", kind="finding")
            facts.nonfinite = str(intact)
            facts.nonfinite_layer = intact.layer
        if broken is not None:
            bmodel, how = broken
            s.text("A deliberately broken copy:")
            s.text(how + "\norigin = hs.find_nonfinite(broken, x)", kind="code")
            origin = find_nonfinite(bmodel, x1)
            if origin is None:
                s.text("No NaN or Inf was found in the broken copy.", kind="note")
                facts.nonfinite = "none found in the broken copy"
            else:
                s.text(str(origin), kind="finding")
                s.table(
                    ["layer", "type", "pass", "call", "kind", *origin.stats],
                    [
                        [
                            origin.layer,
                            origin.module_type,
                            origin.phase,
                            origin.call,
                            origin.kind,
                            *(f"{v:.4g}" for v in origin.stats.values()),
                        ]
                    ],
                )
                facts.nonfinite = str(origin)
                facts.nonfinite_layer = (
                    f"{origin.layer} ({origin.module_type})" if origin.module_type else origin.layer
                )

    _guard(facts, s, "nan origin", run)


# -- whole reports ------------------------------------------------------------------------------
def build_demo_report(
    *, n_images: int = 8, steps: int = 20, seed: int | None = None
) -> tuple[Report, ReportFacts]:
    """The report of ``hookscope demo``: the built-in model on fresh test images."""
    from ._data import make_demo_dataset
    from ._model import TEST_SEED, load_demo_model

    model = load_demo_model()
    data = make_demo_dataset(n_images, seed=TEST_SEED + 1 if seed is None else seed)
    x, shown = data.images, data.images
    facts = ReportFacts(model=type(model).__name__)
    report = Report(
        "hookscope demo: inside a small trained CNN",
        subtitle=f"{type(model).__name__} tells {', '.join(model.classes)} apart in 64×64 pictures; "
        "everything below was measured through PyTorch hooks, without changing the model's code.",
    )
    summary_section(report, facts, model, x[:1])
    maps_section(
        report,
        facts,
        model,
        x[:1],
        shown[0].permute(1, 2, 0).numpy(),
        ["stage1", "stage2", "stage3"],
    )
    cam_section(
        report,
        facts,
        model,
        "stage3",
        x,
        shown,
        classes=model.classes,
        labels=data.labels,
        boxes=data.boxes,
    )
    flow_section(report, facts, steps=steps)
    nonfinite_section(report, facts, model, x[:1], broken=break_demo_model(model))
    _kpis(report, facts)
    return report, facts


def build_model_report(
    model: nn.Module, x: torch.Tensor, shown: Any, *, name: str, layer: str | None = None
) -> tuple[Report, ReportFacts]:
    """The report of ``hookscope report MODEL --image PATH``: one preprocessed image ``x``
    ``(1, C, H, W)`` and the picture shown for it ``shown`` (``(H, W, 3)`` float in [0, 1])."""
    from ..core._select import resolve

    if layer is not None:
        layer = next(iter(resolve(model, layer)))  # an unknown name fails here, naming the closest
    facts = ReportFacts(model=name)
    report = Report(f"hookscope report: {name}", subtitle=f"one image, input {tuple(x.shape)}")
    summary_section(report, facts, model, x)
    spatial = spatial_children(model, x)
    maps_layers = spatial[-4:]
    if layer is not None and layer not in maps_layers:
        maps_layers = [*maps_layers[-3:], layer]
    maps_section(report, facts, model, x, shown, maps_layers)
    cam_layer = layer or (spatial[-1] if spatial else None)
    shown_t = torch.as_tensor(shown).permute(2, 0, 1)[None].float()
    if cam_layer is None:
        report.section(
            "Grad-CAM", note="no layer with a (B, C, H, W) output found; give one with --layer"
        )
    else:
        cam_section(
            report, facts, model, cam_layer, x, shown_t, classes=getattr(model, "classes", None)
        )
    report.section(
        "Gradient flow",
        note="omitted: it needs a training loop with labelled data. In yours: mon = hs.Monitor(model); "
        "call mon.step(optimizer) after each optimizer.step(); then mon.plot('flow.png').",
    )
    nonfinite_section(report, facts, model, x)
    _kpis(report, facts)
    return report, facts


def _kpis(report: Report, facts: ReportFacts) -> None:
    if facts.params is not None:
        report.kpi(f"{facts.params:,}", "parameters")
    if facts.correct is not None:
        report.kpi(f"{facts.correct}/{facts.shown}", "test images classified right")
    if facts.cam_in_box is not None:
        report.kpi(f"{facts.cam_in_box}/{facts.correct or 0}", "Grad-CAM peaks inside the shape")
    if "gradient flow" in facts.seconds and "gradient flow" not in facts.unavailable:
        report.kpi(str(len(facts.flow_alerts)), "monitor alerts")
    if facts.nonfinite_layer:
        report.kpi(facts.nonfinite_layer, "first NaN/Inf produced by")
