"""Every torchvision classification model, and a dozen timm families, random weights, small
inputs: ``FeatureExtractor`` gives each layer's own output at three layers per model, including a
residual site (a norm whose output the model changes in place later, ``out += identity``), and
``summary`` counts every unique parameter once.

References, independent of hookscope: the layer's output recorded by a plain forward hook that
clones it (always; ``tests/helpers/zoo.py``), and torchvision's FX feature extractor wherever FX can trace the model. FX
runs on the same model with every ``inplace=True`` flag turned off and the traced graph's
functional in-place ops made out-of-place: in an FX graph an in-place module or function
(``ReLU(inplace=True)``, ``F.relu(x, inplace=True)``) still changes the tensor FX hands back, so FX
itself returns the post-ReLU values there; a Python ``+=`` is traced as an out-of-place add. Layers whose name ends in
``_<digit>`` are not compared with FX: its node names mark the N-th call of a module with that
suffix, so ``encoder_layer_4.ln_1`` resolves to a different node (``ln_2``).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torchvision

import hookscope as hs
from helpers.zoo import cheap_init, pick_layers, unique_params

pytestmark = pytest.mark.slow

TV_MODELS = torchvision.models.list_models(module=torchvision.models)
TIMM_MODELS = [
    "resnet18",
    "resnet10t",
    "convnext_atto",
    "efficientnet_b0",
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "regnetx_002",
    "mobilenetv3_small_050",
    "densenet121",
    "dla34",
    "ghostnet_100",
    "mixer_s16_224",
]
_FX_BAD_NAME = re.compile(r"_\d+$")
_SMALL_INPUT = (
    "regnet",
    "efficientnet",
    "resnet",
    "resnext",
    "wide_resnet",
    "convnext",
    "densenet",
    "vgg",
)


@pytest.fixture(autouse=True, scope="module")
def _no_denormals():
    """Random weights drive some activations into denormal floats, which the CPU computes ~30x
    slower (efficientnet_b5: 4.5 s per 64x64 forward); flushing them keeps the sweep to minutes.
    hookscope and every reference run under the same setting."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


def _tv(name: str) -> tuple[nn.Module, int]:
    kw: dict[str, Any] = {}
    # the deep CNN families at 32x32 (their compute is most of the sweep's time), the rest at 64
    size = 32 if name.startswith(_SMALL_INPUT) else 64
    if name.startswith("vit_"):
        size = 4 * int(name.rsplit("_", 1)[1])  # 4x4 patches (image_size is a constructor arg)
        kw["image_size"] = size
    elif name.startswith("maxvit"):
        size = 224  # its partition sizes are fixed for 224
    elif name.startswith("inception"):
        size = 75  # the smallest input it accepts
    if name in ("googlenet", "inception_v3"):
        kw["init_weights"] = True  # cheap under cheap_init; silences their FutureWarning
    with cheap_init():
        torch.manual_seed(0)
        return torchvision.models.get_model(name, weights=None, **kw).eval(), size


def _timm(name: str) -> tuple[nn.Module, int]:
    timm = pytest.importorskip("timm")
    size = 224 if any(k in name for k in ("vit", "deit", "swin", "mixer")) else 64
    with cheap_init():
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False).eval(), size


@contextlib.contextmanager
def _out_of_place(model: nn.Module):
    flagged = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for m in flagged:
        m.inplace = False
    try:
        yield
    finally:
        for m in flagged:
            m.inplace = True


def _graph_out_of_place(gm: Any) -> None:
    """Functional in-place ops in the traced graph (``F.relu(x, inplace=True)`` in googlenet,
    ``x.add_(y)``) made out-of-place, so FX hands back each node's value as computed."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
        elif (
            node.op == "call_method"
            and node.target.endswith("_")
            and not node.target.startswith("_")
        ) and hasattr(torch.Tensor, node.target[:-1]):
            node.target = node.target[:-1]
    gm.recompile()


def _fx_nodes(model: nn.Module) -> set[str] | None:
    from torchvision.models.feature_extraction import get_graph_node_names

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return set(get_graph_node_names(model)[1])
    except Exception:  # FX cannot trace this model (data-dependent control flow, ...)
        return None


def _assert_same(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    """Exactly equal (shape, dtype, values); a NaN matches only a NaN at the same place."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")


def _check(model: nn.Module, size: int) -> None:
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    with _out_of_place(model):
        nodes = _fx_nodes(model)
    if nodes is not None:
        nodes = {n for n in nodes if not _FX_BAD_NAME.search(n)}
    layers, site, truth = pick_layers(model, x, nodes)
    assert site in layers and len(layers) == 3, layers
    with torch.no_grad():
        got = hs.FeatureExtractor(model, layers)(x)
    for n in layers:
        _assert_same(got[n], truth[n], f"{n}: differs from the layer's own output")
    if nodes is not None:
        from torchvision.models.feature_extraction import create_feature_extractor

        with _out_of_place(model), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fx = create_feature_extractor(model, return_nodes=layers)
            _graph_out_of_place(fx)
            ref = fx(x)
        for n in layers:
            _assert_same(got[n], ref[n], f"{n}: differs from torchvision's FX extractor")
    s = hs.summary(model, x)
    assert s.totals.params == unique_params(model)


@pytest.mark.parametrize("name", TV_MODELS)
def test_torchvision_model(name):
    model, size = _tv(name)
    _check(model, size)


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_family(name):
    model, size = _timm(name)
    _check(model, size)
