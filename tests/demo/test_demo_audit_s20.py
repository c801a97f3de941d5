"""Every figure of the demo report against a hand computation on the same model and data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hookscope as hs

pytest.importorskip("PIL")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def built():
    from hookscope.demo._report import build_demo_report

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report, facts = build_demo_report(n_images=8, steps=4)
    finally:
        torch.set_num_threads(threads)
    return report, facts


def _hand_gradcam(model, x):
    """Grad-CAM by hand: stage3's output, gradient of the predicted logit, channel means."""
    a = model.stage2(model.stage1(x)).detach()
    a.requires_grad_(True)
    act = model.stage3(a)
    logits = model.head(act)
    pred = logits.argmax(1)
    g = torch.autograd.grad(logits.gather(1, pred[:, None]).sum(), act)[0]
    cam = (g.mean((2, 3), keepdim=True) * act).sum(1).clamp_min(0).detach()
    lo = cam.flatten(1).min(1).values[:, None, None]
    hi = cam.flatten(1).max(1).values[:, None, None]
    cam = (cam - lo) / (hi - lo)
    up = F.interpolate(cam[:, None], size=x.shape[2:], mode="bilinear", align_corners=False)[:, 0]
    return logits.detach(), up


def test_accuracy_and_gradcam_peaks_equal_a_hand_computation(built):
    from hookscope.demo._model import TEST_SEED

    _, facts = built
    model = hs.load_demo_model()
    ds = hs.make_demo_dataset(8, seed=TEST_SEED + 1)
    logits, cams = _hand_gradcam(model, ds.images)
    pred = logits.argmax(1)
    right = pred == ds.labels
    peaks = cams.flatten(1).argmax(1)
    px, py = peaks % 64, peaks // 64
    b = ds.boxes
    inside = (b[:, 0] <= px) & (px <= b[:, 2]) & (b[:, 1] <= py) & (py <= b[:, 3])
    assert facts.shown == 8 and facts.correct == int(right.sum())
    assert facts.cam_in_box == int((inside & right).sum())
    probs = logits.softmax(1)
    assert facts.predictions == [
        f"{model.classes[int(k)]} ({float(probs[i, k]):.0%})" for i, k in enumerate(pred)
    ]
    assert facts.params == sum(p.numel() for p in model.parameters())


def test_flow_section_loss_equals_the_same_training_by_hand(built):
    report, facts = built
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = hs.DemoNet().train()
    data = hs.make_demo_dataset(4 * 16, seed=10_000)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for i in range(4):
        loss = F.cross_entropy(
            net(data.images[i * 16 : (i + 1) * 16]), data.labels[i * 16 : (i + 1) * 16]
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    page = report.to_html()
    assert f"Loss went from {losses[0]:.3f} to {losses[-1]:.3f} in 4 steps." in page
    assert ("monitor raised no alert" in page) == (not facts.flow_alerts)


def test_nan_origin_equals_a_hand_search(built):
    _, facts = built
    from hookscope.demo._model import TEST_SEED
    from hookscope.demo._report import break_demo_model

    broken, _ = break_demo_model(hs.load_demo_model())
    x = hs.make_demo_dataset(8, seed=TEST_SEED + 1).images[:1]
    first = []
    handles = [
        m.register_forward_hook(
            lambda m, i, o, n=n: (
                first.append((n, i[0].abs().max(), o.isnan().sum()))
                if not first and not torch.isfinite(o).all()
                else None
            )
        )
        for n, m in broken.named_modules()
        if not list(m.children())
    ]
    try:
        with torch.no_grad():
            broken(x)
    finally:
        for h in handles:
            h.remove()
    (name, absmax, nans), *_ = first
    assert name == "stage2.4" and facts.nonfinite_layer == "stage2.4 (BatchNorm2d)"
    assert f"input_absmax={float(absmax):.4g}" in facts.nonfinite
    assert f"output_nan={int(nans)}," in facts.nonfinite
