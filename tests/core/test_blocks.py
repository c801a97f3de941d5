"""``hs.blocks``: the repeated blocks of a model, of both stacks of an encoder–decoder model."""

from __future__ import annotations

import pytest
import torch.nn as nn

import hookscope as hs
from helpers.lm import tiny_bart, tiny_gpt2, tiny_t5


def test_blocks_of_a_decoder_only_model_and_a_stage_list():
    assert list(hs.blocks(tiny_gpt2())) == ["transformer.h.0", "transformer.h.1"]
    stages = nn.Sequential(  # a ResNet-like list of stages: the stages are the blocks
        nn.Conv2d(3, 4, 1),
        *(nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)) for _ in range(3)),
    )
    assert list(hs.blocks(stages)) == ["1", "2", "3"]


@pytest.mark.parametrize(
    ("make", "enc", "dec"),
    [
        (tiny_t5, "encoder.block", "decoder.block"),
        (tiny_bart, "model.encoder.layers", "model.decoder.layers"),
    ],
    ids=["t5", "bart"],
)
def test_blocks_of_an_encoder_decoder_model_are_those_of_both_stacks(make, enc, dec):
    """T5 gave its two stacks ['encoder', 'decoder']; BART only its decoder's layers."""
    model = make()
    want = [f"{enc}.0", f"{enc}.1", f"{dec}.0", f"{dec}.1"]
    assert list(hs.blocks(model)) == want
    assert list(hs.blocks(model, within=dec.rsplit(".", 1)[0])) == want[2:]
    for name, module in hs.blocks(model).items():
        assert module is model.get_submodule(name)


def test_blocks_of_a_plain_encoder_decoder_module():
    """Without a Transformers config: two same-class children that each hold a list of blocks
    are stacks."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(4, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = Stack(), Stack()

    got = list(hs.blocks(EncDec()))
    assert got == [f"{s}.layers.{i}" for s in ("enc", "dec") for i in range(3)]


def test_blocks_errors_name_the_fix():
    model = tiny_t5()
    with pytest.raises(hs.LayerNotFoundError, match="within='decoderr'.*'decoder'"):
        hs.blocks(model, within="decoderr")
    with pytest.raises(hs.LayerNotFoundError, match="no submodule 'attn'.*within= picks one"):
        hs.blocks(model, "attn")
    with pytest.raises(hs.LayerNotFoundError, match="no repeated blocks under 'lm_head'"):
        hs.blocks(model, within="lm_head")
    assert list(hs.blocks(model, "layer.0")) == [  # a child of every block of both stacks
        f"{s}.block.{i}.layer.0" for s in ("encoder", "decoder") for i in range(2)
    ]
