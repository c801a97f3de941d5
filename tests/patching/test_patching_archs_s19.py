"""Activation patching on architectures beyond the GPT-2/Llama family (hybrid Mamba/attention,
sliding-window + global attention, mixture of experts, ALiBi, state-space), each sweep against a
loop of forwards patched by hand with plain PyTorch hooks (random weights, CPU)."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from helpers.lm import EOS, PAD, WORDS
from helpers.patch_refs import by_position, hand_sweep

CFG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)


def _build(config: str, model: str, **fields):
    import transformers

    common = dict(vocab_size=len(WORDS), bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg = getattr(transformers, config)(**(common | fields), attn_implementation="eager")
    torch.manual_seed(0)
    return getattr(transformers, model)(cfg).eval()


def tiny_jamba(layers: int = 4):
    """Jamba: Mamba layers and attention layers alternate in one ``ModuleList``."""
    return _build(
        "JambaConfig",
        "JambaForCausalLM",
        **(CFG | {"num_hidden_layers": layers}),
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=8,
    )


ARCHS = {
    # Gemma-3: a sliding-window layer (window 4) and a global one, logit softcapping
    "gemma3": lambda: _build(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        **CFG,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
    ),
    "mixtral": lambda: _build(
        "MixtralConfig",
        "MixtralForCausalLM",
        **CFG,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "falcon_alibi": lambda: _build(
        "FalconConfig",
        "FalconForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        multi_query=True,
        parallel_attn=True,
    ),
    "mamba2": lambda: _build(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        head_dim=16,
        num_heads=8,
        n_groups=1,
        chunk_size=8,
    ),
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
