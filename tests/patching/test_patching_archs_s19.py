"""Activation patching on architectures beyond the GPT-2/Llama family (hybrid Mamba/attention,
sliding-window + global attention, mixture of experts, ALiBi, state-space), each sweep against a
loop of forwards patched by hand with plain PyTorch hooks (random weights, CPU)."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import WORDS, tiny_decoder, tiny_falcon_alibi, tiny_jamba, tiny_mamba2
from helpers.patch_refs import by_position, hand_sweep

ARCHS = {
    "gemma3": lambda: tiny_decoder("gemma3"),
    "mixtral": lambda: tiny_decoder("mixtral"),
    "falcon_alibi": tiny_falcon_alibi,
    "mamba2": tiny_mamba2,
}

G = torch.Generator().manual_seed(3)
CLEAN = torch.randint(3, len(WORDS), (1, 8), generator=G)
CORRUPT = CLEAN.clone()
CORRUPT[0, [2, 5]] = torch.tensor([7, 8])


def metric(out):
    return (out.logits[:, -1, 7] - out.logits[:, -1, 8]).mean()


def _hand(model, names, at):
    return torch.stack(
        [
            hand_sweep(
                model,
                model.get_submodule(n),
                at,
                {"input_ids": CLEAN},
                {"input_ids": CORRUPT},
                metric,
                by_position,
            )
            for n in names
        ]
    )


def test_blocks_of_a_hybrid_stack_are_every_layer_and_the_sweep_covers_them():
    # Jamba's layers alternate two classes in one ModuleList: hs.blocks took the layers of the
    # largest class only (the attention layers 1 and 3 of 4; with 2 layers, the four Linear
    # projections of layer 0's Mamba mixer), so a sweep over hs.blocks(model) silently skipped
    # half the model's layers
    model = tiny_jamba(layers=4)
    names = [f"model.layers.{i}" for i in range(4)]
    assert list(hs.blocks(model)) == names
    got = hs.patch_sweep(model, CLEAN, CORRUPT, metric, hs.blocks(model), at="input")
    ref = _hand(model, names, "input")
    assert ref.abs().max() > 1e-3
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert list(hs.blocks(tiny_jamba(layers=2))) == names[:2]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_position_sweeps_equal_hand_written_hooks(arch):
    model = ARCHS[arch]()
    names = list(hs.blocks(model))
    assert len(names) == 2
    for at in ("input", "output"):
        got = hs.patch_sweep(model, CLEAN, CORRUPT, metric, names, at=at)
        ref = _hand(model, names, at)
        assert ref.abs().max() > 1e-3
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
