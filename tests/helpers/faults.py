"""Small models with random weights and single-module faults, for ``hs.compare``'s tests and
benchmarks: a Llama-style decoder (GQA, RoPE, RMSNorm) from a transformers ``LlamaConfig``, a CNN
with BatchNorm, a small torchvision ViT. A fault changes one module of a copy; its entry names the
module that must be found."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.lm import tiny_llama


def _reinit(model: nn.Module, seed: int) -> nn.Module:
    """Weights with unit-scale activations (HF's 0.02 init makes attention nearly uniform, so
    faults in it would have no effect)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p[0].numel()
                std = 1.0 if "embed" in name else fan_in**-0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name or "ln" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def lm_loss(out: Any) -> torch.Tensor:
    """The language models' loss (module level, so a record can be made in another process)."""
    return out.logits.float().logsumexp(-1).mean()


def logsumexp_loss(out: torch.Tensor) -> torch.Tensor:
    """The image models' loss (module level, so a record can be made in another process)."""
    return out.logsumexp(-1).mean()


def llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
    model = _reinit(tiny_llama(n_layer=2, hidden=64, heads=4, kv_heads=2, seed=0), 0)
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"use_cache": False}, lm_loss


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.act1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.act2 = nn.ReLU()
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act1(self.bn1(self.conv1(x))))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.fc(self.avg(x).flatten(1))


def cnn() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = CNN().train()  # BatchNorm on batch statistics, as in training
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return model, (x,), {}, logsumexp_loss


def vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    ).eval()  # fmt: skip
    _reinit(model, 0)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return model, (x,), {}, logsumexp_loss


MODELS = {"llama": llama, "cnn": cnn, "vit": vit}


# -- faults ---------------------------------------------------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float) -> torch.Tensor:
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g * ctx.s, None


class BadBackwardLinear(nn.Linear):
    """Forward exact; backward scales the output gradient by 1.5 (a wrong custom backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(super().forward(x), 1.5)


class BadBackwardConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(super().forward(x), 1.5)


class Bf16Linear(nn.Linear):
    """Computes in bfloat16, returns the input's dtype (one projection left in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.bfloat16()
        return F.linear(x.bfloat16(), self.weight.bfloat16(), b).to(x.dtype)


class Bf16Conv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.bfloat16()
        return self._conv_forward(x.bfloat16(), self.weight.bfloat16(), b).to(x.dtype)


class CompiledOnly(nn.Module):
    """Wraps a module; its output is off by 10% only inside a compiled program."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *a: Any, **k: Any) -> Any:
        out = self.inner(*a, **k)
        return out * 1.1 if torch.compiler.is_compiling() else out


def _swap(cls: type) -> Callable[[nn.Module], None]:
    def apply(m: nn.Module) -> None:
        m.__class__ = cls

    return apply


def _child(attr: str, factory: Callable[[], nn.Module]) -> Callable[[nn.Module], None]:
    def apply(parent: nn.Module) -> None:
        setattr(parent, attr, factory())

    return apply


def _set(attr: str, value: Any) -> Callable[[nn.Module], None]:
    def apply(m: nn.Module) -> None:
        setattr(m, attr, value(getattr(m, attr)) if callable(value) else value)

    return apply


def _noise(scale: float) -> Callable[[nn.Module], None]:
    def apply(m: nn.Module) -> None:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            w = m.weight
            w.add_(
                torch.randn(w.shape, generator=g).to(w.dtype)
                * scale
                * w.detach().float().std().to(w.dtype)
            )

    return apply


@dataclasses.dataclass(frozen=True)
class Fault:
    """One change of one module of ``model``: ``apply(module)`` on the module named ``culprit``
    (a copy), or on ``target`` when the change is made there (e.g. a buffer of a parent).
    ``bf16``: whether the fault is one in a bf16 run too (a projection left in bf16 is not)."""

    id: str
    model: str
    culprit: str
    apply: Callable[[nn.Module], None]
    bf16: bool = True
    target: str | None = None


def _rope(m: nn.Module) -> None:
    m.inv_freq.mul_(1.3)
    m.original_inv_freq = m.inv_freq


def _pos(m: nn.Module) -> None:
    with torch.no_grad():
        m.pos_embedding.add_(
            0.5 * torch.randn(m.pos_embedding.shape, generator=torch.Generator().manual_seed(3))
        )


FAULTS = [
    Fault(
        "llama-norm-eps", "llama", "model.layers.0.input_layernorm", _set("variance_epsilon", 1.0)
    ),
    Fault("llama-final-norm-eps", "llama", "model.norm", _set("variance_epsilon", 1.0)),
    Fault(
        "llama-attn-scaling",
        "llama",
        "model.layers.1.self_attn",
        _set("scaling", lambda s: s * 2.0),
    ),
    Fault("llama-rope-freq", "llama", "model.rotary_emb", _rope),
    Fault(
        "llama-act-gelu",
        "llama",
        "model.layers.0.mlp.act_fn",
        _child("act_fn", nn.GELU),
        target="model.layers.0.mlp",
    ),
    Fault(
        "llama-o-proj-bf16",
        "llama",
        "model.layers.1.self_attn.o_proj",
        _swap(Bf16Linear),
        bf16=False,
    ),
    Fault(
        "llama-down-proj-backward",
        "llama",
        "model.layers.0.mlp.down_proj",
        _swap(BadBackwardLinear),
    ),
    Fault("llama-k-proj-weights", "llama", "model.layers.1.self_attn.k_proj", _noise(0.2)),
    Fault("llama-up-proj-weights", "llama", "model.layers.1.mlp.up_proj", _noise(0.2)),
    Fault("cnn-bn-eps", "cnn", "bn1", _set("eps", 1.0)),
    Fault("cnn-act-leaky", "cnn", "act2", _child("act2", lambda: nn.LeakyReLU(0.3)), target=""),
    Fault("cnn-pool-avg", "cnn", "pool", _child("pool", lambda: nn.AvgPool2d(2)), target=""),
    Fault("cnn-conv-reflect", "cnn", "conv2", _set("padding_mode", "reflect")),
    Fault("cnn-conv1-backward", "cnn", "conv1", _swap(BadBackwardConv)),
    Fault("cnn-conv2-bf16", "cnn", "conv2", _swap(Bf16Conv), bf16=False),
    Fault("cnn-fc-weights", "cnn", "fc", _noise(0.2)),
    Fault("vit-ln-eps", "vit", "encoder.layers.encoder_layer_0.ln_1", _set("eps", 1.0)),
    Fault(
        "vit-heads", "vit", "encoder.layers.encoder_layer_1.self_attention", _set("num_heads", 2)
    ),
    Fault(
        "vit-act-silu",
        "vit",
        "encoder.layers.encoder_layer_0.mlp.1",
        _child("1", nn.SiLU),
        target="encoder.layers.encoder_layer_0.mlp",
    ),
    Fault("vit-pos-embedding", "vit", "encoder", _pos),
    Fault("vit-patch-bf16", "vit", "conv_proj", _swap(Bf16Conv), bf16=False),
    Fault("vit-head-backward", "vit", "heads.head", _swap(BadBackwardLinear)),
    Fault("vit-final-ln-eps", "vit", "encoder.ln", _set("eps", 1.0)),
]


def faulty(model: nn.Module, fault: Fault) -> nn.Module:
    """A deep copy of ``model`` with ``fault`` applied."""
    b = copy.deepcopy(model)
    fault.apply(b.get_submodule(fault.culprit if fault.target is None else fault.target))
    return b


def relative_effect(a: nn.Module, b: nn.Module, name: str, inputs: tuple, kwargs: dict) -> float:
    """How much the fault changes its module's output on the same inputs (for the fault table)."""
    import hookscope as hs

    with hs.capture(a, name, inputs=True) as cap:
        a(*inputs, **kwargs)
    call = cap.last(name)
    with torch.no_grad():
        out = b.get_submodule(name)(*call.inputs.args, **call.inputs.kwargs)
    ref = call.output
    ref = ref[0] if isinstance(ref, tuple) else ref
    out = out[0] if isinstance(out, tuple) else out
    return float((out - ref).norm() / ref.norm()) if ref.norm() > 0 else math.inf
