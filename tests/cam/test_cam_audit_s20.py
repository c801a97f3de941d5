"""Audit s20 of the CAM product: each map equals its published formula computed by hand with
plain PyTorch hooks (``register_forward_hook`` / ``register_full_backward_hook``), or the call
is refused naming the layer and the fix."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs

# these tests give every method a target; EigenCAM ignores it, which it says (tested in
# test_cam_eigencam_target_s20.py)
pytestmark = pytest.mark.filterwarnings("ignore:EigenCAM. target=.* is ignored")


def _cam(method: str, net: nn.Module, layer: str, **kw):
    """The method's CAM object (ScoreCAM without its progress bar)."""
    if method == "scorecam":
        kw.setdefault("progress", False)
    return hs.get_cam(method)(net, layer, **kw)


def _minmax(m: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(1, m.ndim))
    m = m - m.amin(dim=dims, keepdim=True)
    return m / (1e-7 + m.amax(dim=dims, keepdim=True))


def _finish(m: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """ReLU, per-sample min-max, bilinear upsampling (align_corners=False), min-max: cam.md."""
    m = _minmax(m.clamp_min(0))
    if tuple(m.shape[1:]) != size:
        m = F.interpolate(m[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return _minmax(m)


def _formula(method: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if method == "gradcam":
        return (g.mean(dim=(2, 3), keepdim=True) * a).sum(1)
    if method == "hirescam":
        return (g * a).sum(1)
    assert method == "layercam"
    return (g.clamp_min(0) * a).sum(1)


def _hand_grad_map(model, layer, x, score, method, grid=lambda t: t):
    """The layer's output at its call (a forward hook's copy) and the gradient of the score at
    that output (a full backward hook's ``grad_output``), then the method's formula."""
    seen = {}
    h1 = layer.register_forward_hook(lambda m, i, o: seen.__setitem__("a", o.detach().clone()))
    h2 = layer.register_full_backward_hook(lambda m, gi, go: seen.__setitem__("g", go[0]))
    try:
        score(model(x)).sum().backward()
    finally:
        h1.remove()
        h2.remove()
        model.zero_grad(set_to_none=True)
    return _finish(_formula(method, grid(seen["a"]), grid(seen["g"])), tuple(x.shape[2:]))


def _hand_scorecam(model, layer, x, classes):
    """Score-CAM: each channel's upsampled (align_corners=True), min-max normalised map masks the
    input; the softmax of the masked inputs' class scores weighs the channels."""
    seen = {}
    h = layer.register_forward_hook(lambda m, i, o: seen.__setitem__("a", o.detach().clone()))
    with torch.no_grad():
        try:
            model(x)
        finally:
            h.remove()
        a = seen["a"]
        w = torch.empty(a.shape[:2])
        for i in range(a.shape[0]):
            for c in range(a.shape[1]):
                up = F.interpolate(
                    a[i, c][None, None], size=x.shape[2:], mode="bilinear", align_corners=True
                )
                mask = (up - up.min()) / (up.max() - up.min() + 1e-8)
                w[i, c] = model(x[i : i + 1] * mask)[0, classes[i]]
        m = (w.softmax(1)[:, :, None, None] * a).sum(1)
    return _finish(m, tuple(x.shape[2:]))


# -- sequence-first tokens -------------------------------------------------------------------


class SeqFirstViT(nn.Module):
    """Patch tokens in PyTorch's default transformer layout (N, B, C), a class token first (as
    OpenAI's CLIP and nn.TransformerEncoderLayer without batch_first)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 16, 8, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        t = self.patch(x).flatten(2).permute(2, 0, 1)  # (N, B, C)
        t = torch.cat([self.cls.expand(1, x.shape[0], -1), t])
        return self.head(self.enc(t)[0])


@pytest.mark.parametrize("batch", [1, 2])
def test_sequence_first_tokens_are_refused_not_read_as_the_batch(batch):
    """(17, B, 16) tokens of a 32x32 image were read as 17 samples of B tokens (a 1x1 grid after a
    "class token" for B=2): 17 maps of shape (32, 32) for a batch of B, silently."""
    net = SeqFirstViT().eval()
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for method in ("gradcam", "eigencam", "scorecam"):
        with pytest.raises(
            hs.ReshapeError, match=r"layer 'enc'.*17 maps for a batch of .*reshape=fn"
        ):
            _cam(method, net, "enc")(x, target=2)
    # the fix the message gives equals the hand reference
    grid = lambda t: t[1:].permute(1, 2, 0).unflatten(2, (4, 4))  # noqa: E731
    # the head reads enc's class token only, so the gradient on its patch tokens (the grid) is
    # zero: the map is all zeros, and (on CPU) a warning says so
    with pytest.warns(hs.HookscopeWarning, match=r"layer 'enc' is zero everywhere"):
        got = hs.GradCAM(net, "enc", reshape=grid)(x, target=2)
    want = _hand_grad_map(net, net.enc, x, lambda out: out[:, 2], "gradcam", grid)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# -- ScoreCAM and target functions -----------------------------------------------------------


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    ).eval()  # fmt: skip


@pytest.mark.parametrize(
    ("batch_size", "fn"),
    [
        (2, lambda out: out.gather(1, torch.tensor([[0], [2]]))[:, 0]),  # a class per sample
        (4, lambda out: out[:, 2] - out[:, 2].mean()),  # relative to the other rows
    ],
    ids=["class-per-sample", "batch-relative"],
)
def test_scorecam_refuses_a_target_function_scoring_rows_by_position(batch_size, fn):
    """ScoreCAM calls the target function on masked copies of one sample. ``out.gather(1,
    classes)`` (one class per sample of the batch) with batch_size == B scored the second copy
    against the second sample's class: 0.10 off the map of target=[0, 2]; a score relative to
    the batch's mean scored each copy against the other copies (0.0028 off). Both silently."""
    net = small_net()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cam = hs.ScoreCAM(net, "2", batch_size=batch_size, progress=False)
    with pytest.raises(
        hs.CAMError, match="scores the rows of a batch by their position or against each other"
    ):
        cam(x, target=fn)
    want = _hand_scorecam(net, net[2], x, [0, 2])
    torch.testing.assert_close(cam(x, target=[0, 2]), want, atol=1e-6, rtol=0)
    # a function scoring every row alike is kept: it equals the class index
    torch.testing.assert_close(
        cam(x, target=lambda out: out[:, 2]),
        _hand_scorecam(net, net[2], x, [2, 2]),
        atol=1e-6,
        rtol=0,
    )


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x):
        return self.head(self.conv(self.conv(x)).mean((2, 3)))


def test_scorecam_with_a_target_function_refuses_a_layer_called_twice():
    """With a class index it was refused; with a function the forward stopped at the layer's
    first call and ScoreCAM weighed that call's channels, silently."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(hs.CAMError, match="layer 'conv' ran more than once"):
        hs.ScoreCAM(Twice().eval(), "conv", progress=False)(x, target=lambda out: out[:, 1])


# -- class indices ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gradcam", "scorecam"])
@pytest.mark.parametrize(
    "target",
    [
        torch.tensor([0.9, 2.7]),  # was read as classes 0 and 2
        torch.tensor([True, False]),  # a mask, was read as classes 1 and 0
        [1.5, 2],  # was read as classes 1 and 2
        [True, 2],
        np.float32(1.7),
    ],
    ids=["float-tensor", "bool-tensor", "float-list", "bool-list", "numpy-float"],
)
def test_non_integer_class_indices_are_refused(method, target):
    net = small_net()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cam = _cam(method, net, "2")
    with pytest.raises(hs.CAMError, match="class indices must be"):
        cam(x, target=target)
    # integers of every kind still work
    want = cam(x, target=[0, 2])
    for ok in (torch.tensor([0, 2]), np.array([0, 2]), [np.int64(0), torch.tensor(2)]):
        torch.testing.assert_close(cam(x, target=ok), want)


# -- activations sharing memory with the layer's input ----------------------------------------


class Tapped(nn.Module):
    """A placeholder layer (``nn.Identity``, as timm's ``ls1``/``drop_path``/``norm_pre``) whose
    input the parent then changes in place (``h += ...``, an in-place residual)."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inplace = inplace
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.tap = nn.Identity()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv(x)
        y = self.tap(h)  # y is h
        z = self.conv2(y)
        if self.inplace:
            h += z
        else:
            h = h + z
        return self.head(h.relu().mean((2, 3)))


@pytest.mark.parametrize("method", ["gradcam", "hirescam", "layercam", "scorecam"])
def test_an_output_sharing_the_layer_s_input_is_read_as_the_layer_returned_it(method):
    """The activation kept was the input's memory, which ``h += z`` changed after the layer ran:
    the maps of ``h + conv2(h)`` instead of ``h`` (GradCAM 0.47 off the hand reference)."""
    net = Tapped().eval()
    twin = Tapped(inplace=False).eval()  # the same function, out of place: the hand reference's
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cam = _cam(method, net, "tap")
    got = cam(x, target=[0, 2])
    if method == "scorecam":
        want = _hand_scorecam(twin, twin.tap, x, [0, 2])
    else:
        want = _hand_grad_map(
            twin, twin.tap, x, lambda o: o.gather(1, torch.tensor([[0], [2]]))[:, 0], method
        )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# -- the command line ------------------------------------------------------------------------

CLI_MODELS = """
import torch, torch.nn as nn

def Tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 5))

def Seg():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1))
"""


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        # was "only one element tensors can be converted to Python scalars"
        ("Seg", [], r"the model gives \(1, 4, 24, 24\), not \(1, num_classes\).*--target K"),
        # --target was dropped without a word: a class-agnostic map written as asked
        ("Tiny", ["--method", "eigencam", "--target", "3"], "eigencam is class-agnostic"),
    ],
    ids=["segmentation-without-target", "eigencam-with-target"],
)
def test_cli_cam_bad_target_is_one_line_exit_2_and_no_file(tmp_path, capsys, model, extra, message):
    pil = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    from hookscope.cli import main

    (tmp_path / "models.py").write_text(CLI_MODELS)
    rng = np.random.default_rng(0)
    pil.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    argv = ["cam", f"{tmp_path}/models.py:{model}", "--image", str(tmp_path / "img.png")]
    argv += ["--layer", "0", "--crop", "24", "--out", str(tmp_path / "out.png"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.png", "models.py"]
