"""hs.compare on architectures beyond the fault suite's (GPT-2 with tied weights, BERT, T5 and
BART encoder-decoders, Mamba, ResNet in eval and train mode, MobileNetV3 and EfficientNet with
in-place activations, nn.Transformer whose attention never calls its out_proj): a fault-free copy in fp32
and in bf16 names no culprit, and one weight scaled by 1.2 is named (its module; an uncalled
out_proj's fault is its attention's), in fp32 and in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

import hookscope as hs
from helpers import lm
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)

IDS = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(1))
IMG = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def _lm_loss(o):
    return (o.logits if hasattr(o, "logits") else o.last_hidden_state).float().logsumexp(-1).mean()


def _img_loss(o):
    return o.float().logsumexp(-1).mean()


def _seq2seq() -> dict:
    return {"input_ids": IDS, "decoder_input_ids": IDS[:, :5], "use_cache": False}


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True).eval()


def _tv(name: str, train: bool) -> nn.Module:
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)(num_classes=10)
    return m.train() if train else m.eval()


# name -> (build, args, kwargs, loss, the module to break, the module to be named)
CASES = {
    "gpt2": (lm.tiny_gpt2, (IDS,), {"use_cache": False}, _lm_loss, "transformer.h.1.attn.c_proj"),
    "bert": (lm.tiny_bert, (IDS,), {}, _lm_loss, "encoder.layer.0.attention.output.dense"),
    "t5": (lm.tiny_t5, (), _seq2seq(), _lm_loss, "decoder.block.0.layer.2.DenseReluDense.wo"),
    "bart": (lm.tiny_bart, (), _seq2seq(), _lm_loss, "model.decoder.layers.0.self_attn.out_proj"),
    "mamba": (lm.tiny_mamba, (IDS,), {"use_cache": False}, _lm_loss,
              "backbone.layers.1.mixer.out_proj"),
    "resnet18-eval": (lambda: _tv("resnet18", False), (IMG,), {}, _img_loss, "layer2.0.conv1"),
    "resnet18-train": (lambda: _tv("resnet18", True), (IMG,), {}, _img_loss, "layer3.1.conv2"),
    "mobilenet_v3": (lambda: _tv("mobilenet_v3_small", False), (IMG,), {}, _img_loss,
                     "features.2.block.0.0"),
    # in-place SiLU inside squeeze-excitation, `result += input` in MBConv: gradients of values
    # changed in place (the fp32 copy named a culprit when they were lost)
    "efficientnet_b0": (lambda: _tv("efficientnet_b0", False), (IMG,), {}, _img_loss,
                        "features.5.0.block.1.0"),
    "transformer": (_transformer, (torch.randn(2, 6, 16), torch.randn(2, 4, 16)), {},
                    lambda o: o.pow(2).sum(), "decoder.layers.0.multihead_attn.out_proj"),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_fault_free_copy_names_nothing_and_a_broken_weight_is_named(name, dtype):
    build, args, kwargs, loss, target = CASES[name]
    a = build()
    assert hs.compare(a, copy.deepcopy(a).to(dtype), *args, loss_fn=loss, **kwargs).culprit is None
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.get_submodule(target).weight.mul_(1.2)
    named = target.removesuffix(".out_proj") if name == "transformer" else target
    report = hs.compare(a, b.to(dtype), *args, loss_fn=loss, **kwargs)
    assert report.culprit == named
