"""Small language models and a local tokenizer for the language-model tests (nothing downloaded).

Every model here has random weights built from a config; the tokenizer is a ``WordLevel``
vocabulary saved to a folder and loaded back with ``PreTrainedTokenizerFast.from_pretrained``, as
a user without a model hub would do. ``tl_bridge`` wraps a *copy* of a model in TransformerLens's
``TransformerBridge`` (it wraps in place), so the model under test stays untouched.
"""

from __future__ import annotations

import copy
import functools
import inspect
import tempfile

import torch

WORDS = [
    "<pad>",
    "<unk>",
    "<eos>",
    "the",
    "a",
    "cat",
    "dog",
    "mary",
    "john",
    "alice",
    "bob",
    "went",
    "to",
    "store",
    "park",
    "gave",
    "ball",
    "bag",
    "book",
    "when",
    "and",
    "then",
    "he",
    "she",
    "it",
    "was",
    "is",
    "happy",
    "sad",
    "love",
    "hate",
    "good",
    "bad",
    "great",
    "terrible",
    "i",
    "you",
    "we",
    "they",
    "like",
    "said",
    "yes",
    "no",
    "very",
    "not",
]
PAD, UNK, EOS = 0, 1, 2


@functools.cache
def _tokenizer_dir() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tempfile.mkdtemp(prefix="hookscope-tok-")
    PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token="<eos>",
    ).save_pretrained(folder)
    return folder


def word_tokenizer(padding_side: str = "right"):
    """A fast tokenizer over ``WORDS`` (pad 0, unk 1, eos/bos 2), loaded from a local folder."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(_tokenizer_dir())
    tok.padding_side = padding_side
    return tok


def _build(config: str, model: str, seed: int, attn: str = "eager", **fields):
    """``transformers.<model>(transformers.<config>(...))`` in eval mode, seeded, over ``WORDS``
    (pad 0, eos/bos 2), with ``fields`` on top."""
    import transformers

    common = dict(vocab_size=len(WORDS), bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg = getattr(transformers, config)(**(common | fields), attn_implementation=attn)
    torch.manual_seed(seed)
    return getattr(transformers, model)(cfg).eval()


def tiny_gpt2(
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 64,
    seed: int = 0,
    attn: str = "eager",
):
    """A random-weight ``GPT2LMHeadModel`` in eval mode (``attn``: ``"eager"`` or ``"sdpa"``)."""
    return _build(
        "GPT2Config",
        "GPT2LMHeadModel",
        seed,
        attn,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
    )


def tiny_llama(
    n_layer: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    attn: str = "eager",
):
    """A random-weight ``LlamaForCausalLM`` with grouped-query attention (``kv_heads < heads``)."""
    return _build(
        "LlamaConfig",
        "LlamaForCausalLM",
        seed,
        attn,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )


def tl_bridge(model, tokenizer=None, name: str = "gpt2"):
    """TransformerLens's ``TransformerBridge`` around a deep copy of ``model`` (same weights)."""
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(
        name, hf_model=copy.deepcopy(model), tokenizer=tokenizer or word_tokenizer()
    )


def tiny_neox(n_layer: int = 2, hidden: int = 64, heads: int = 4, seed: int = 0):
    """A random-weight ``GPTNeoXForCausalLM`` (fused query_key_value, output projection ``dense``)."""
    return _build(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        seed,
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )


def tiny_bert(n_layer: int = 2, hidden: int = 64, heads: int = 4, seed: int = 0):
    """A random-weight ``BertModel`` encoder (heads in ``attention.output.dense``'s input)."""
    return _build(
        "BertConfig",
        "BertModel",
        seed,
        bos_token_id=None,  # an encoder: no bos/eos, as BertConfig leaves them
        eos_token_id=None,
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )


PROMPTS = ["the cat went to the park", "mary gave"]  # 6 and 2 tokens: row 1 is left-padded


def final_forward_inputs(model, sequences: torch.Tensor, prompt_mask: torch.Tensor) -> dict:
    """``generate``'s final sequence as the keyword arguments of one forward (the reference of the
    generation tests): the tokens minus the last (which generate never ran), the attention mask
    with the generated tokens, and, where the model's forward takes them, the position ids
    generate passes: the prompt's (padding at 0), then one more per token."""
    ids = sequences[:, :-1]
    n_new = ids.shape[1] - prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones(len(ids), n_new, dtype=torch.long)], 1)
    prompt_pos = (prompt_mask.cumsum(1) - 1).masked_fill(prompt_mask == 0, 0)
    pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, n_new + 1)], 1)
    kw = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = pos
    return kw


def lm_blocks(model) -> list[str]:
    """The names of a tiny GPT-2's or Llama's decoder blocks, in order."""
    return (
        [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
        if hasattr(model, "transformer")
        else [f"model.layers.{i}" for i in range(len(model.model.layers))]
    )


class PromptBranchLM(torch.nn.Module):
    """Embedding -> block -> (pool, branch): a branch that runs on prompts only, and a pooled
    output without a token axis."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.branch = (
            torch.nn.Embedding(10, 4),
            torch.nn.Linear(4, 4),
            torch.nn.Linear(4, 4),
        )

    def forward(self, input_ids, attention_mask=None):
        h = self.block(self.emb(input_ids))
        if input_ids.shape[1] > 1:
            h = self.branch(h)
        return h.mean(1)


_DECODERS = {
    # name: (config, model, fields on top of hidden size 64, 2 layers, 4 heads)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
    # Gemma-2: one sliding-window layer (window 4) and one full-attention layer (a hybrid cache)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4},
    ),
    # Mistral: every layer attends to a window of 4 tokens
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {"num_key_value_heads": 2, "sliding_window": 4},
    ),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    # Gemma-3: a sliding-window layer (window 4) and a global one, logit softcapping
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
    ),
    # Mixtral: a mixture of 4 experts, 2 per token
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Phi-3: partial rotary embeddings
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 2, "partial_rotary_factor": 0.5},
    ),
    # MiniMax: a linear-attention ("lightning") layer, then a full-attention one; its cache
    # reads its length from layer 0, which holds no keys (get_seq_length() is always 0)
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "block_size": 4,
        },
    ),
}


def tiny_decoder(kind: str, seed: int = 0):
    """A random-weight decoder-only language model of ``kind`` (a key of ``_DECODERS``): hidden
    size 64, 2 layers, 4 heads, 64 positions, eval mode, over ``WORDS``."""
    config, model, extra = _DECODERS[kind]
    sizes = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    if kind != "opt":
        sizes["intermediate_size"] = 128
    return _build(config, model, seed, **(sizes | extra))


def tiny_mamba(seed: int = 0):
    """A random-weight ``MambaForCausalLM`` (a state-space model: its cache is ``cache_params``)."""
    return _build(
        "MambaConfig",
        "MambaForCausalLM",
        seed,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        conv_kernel=4,
    )


def tiny_mamba2(seed: int = 0):
    """A random-weight ``Mamba2ForCausalLM`` (state-space, multi-head; cache ``cache_params``)."""
    return _build(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        seed,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        head_dim=16,
        num_heads=8,
        n_groups=1,
        chunk_size=8,
    )


def tiny_falcon_alibi(seed: int = 0):
    """A random-weight Falcon with ALiBi and multi-query attention (parallel attention and MLP)."""
    return _build(
        "FalconConfig",
        "FalconForCausalLM",
        seed,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        multi_query=True,
        parallel_attn=True,
    )


def tiny_mpt(seed: int = 0):
    """A random-weight MPT (ALiBi; ``use_cache=False`` in its config, so ``generate`` runs
    without a cache by default)."""
    return _build(
        "MptConfig", "MptForCausalLM", seed, d_model=64, n_layers=2, n_heads=4, max_seq_len=64
    )


def tiny_jamba(layers: int = 4, seed: int = 0):
    """A random-weight Jamba: Mamba layers and attention layers alternate in one ``ModuleList``."""
    return _build(
        "JambaConfig",
        "JambaForCausalLM",
        seed,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
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


def tiny_t5(seed: int = 0):
    """A random-weight ``T5ForConditionalGeneration`` (encoder–decoder, relative positions)."""
    return _build(
        "T5Config",
        "T5ForConditionalGeneration",
        seed,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=PAD,
    )


def tiny_bart(seed: int = 0):
    """A random-weight ``BartForConditionalGeneration`` (encoder–decoder, learned positions)."""
    return _build(
        "BartConfig",
        "BartForConditionalGeneration",
        seed,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        decoder_start_token_id=EOS,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )


class HandCacheLM(torch.nn.Module):
    """A small causal LM of its own (no Hugging Face classes) with a hand-written KV cache, in one
    of three styles: ``"dict"`` (the caller passes a dict that each attention fills, as nanoGPT-like
    code does), ``"returned"`` (the model returns ``(logits, cache)`` and the caller passes that
    cache back) or ``"modules"`` (each attention keeps preallocated key/value tensors and writes
    them in place at ``start``, as Meta's reference Llama does). ``start`` is the position of the
    call's first token (the learned position embedding reads it)."""

    class Attn(torch.nn.Module):
        def __init__(self, d: int, style: str) -> None:
            super().__init__()
            self.qkv, self.o, self.style = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), style
            if style == "modules":
                self.cache_k = torch.zeros(4, 32, d)
                self.cache_v = torch.zeros(4, 32, d)

        def forward(self, x, cache=None, start=0):
            q, k, v = self.qkv(x).chunk(3, -1)
            b, t = x.shape[:2]
            if self.style == "modules":
                self.cache_k[:b, start : start + t] = k.detach()
                self.cache_v[:b, start : start + t] = v.detach()
                k, v = self.cache_k[:b, : start + t], self.cache_v[:b, : start + t]
            elif cache is not None:
                if id(self) in cache:
                    pk, pv = cache[id(self)]
                    k, v = torch.cat([pk, k], 1), torch.cat([pv, v], 1)
                cache[id(self)] = (k, v)
            s = k.shape[1]
            keep = torch.ones(t, s, dtype=torch.bool).tril(s - t)
            att = (q @ k.transpose(1, 2) / 4).masked_fill(~keep, float("-inf")).softmax(-1)
            return self.o(att @ v)

    class Block(torch.nn.Module):
        def __init__(self, d: int, style: str) -> None:
            super().__init__()
            self.attn, self.mlp = HandCacheLM.Attn(d, style), torch.nn.Linear(d, d)

        def forward(self, x, cache=None, start=0):
            x = x + self.attn(x, cache=cache, start=start)
            return x + self.mlp(x)

    def __init__(self, style: str = "dict", d: int = 16, vocab: int = 20, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.style = style
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(32, d)
        self.blocks = torch.nn.ModuleList([HandCacheLM.Block(d, style) for _ in range(2)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, cache=None, start=0):
        x = self.emb(input_ids) + self.pos(torch.arange(start, start + input_ids.shape[1]))
        if self.style == "returned":
            cache = {} if cache is None else cache
        for block in self.blocks:
            x = block(x, cache=cache, start=start)
        logits = self.head(x)
        return (logits, cache) if self.style == "returned" else logits

    def decode(self, ids: torch.Tensor, steps: int, cached: bool = True) -> torch.Tensor:
        """Greedy decoding by hand: the prompt, then one call per new token with the cache
        (``cached``), or the whole sequence again at every step without it."""
        seq, cache = ids, ({} if self.style == "dict" else None)
        with torch.no_grad():
            for i in range(steps):
                if not cached:
                    out = self(seq)
                elif i == 0:
                    out = self(seq, cache=cache)
                else:
                    out = self(seq[:, -1:], cache=cache, start=seq.shape[1] - 1)
                if self.style == "returned":
                    out, cache = out
                seq = torch.cat([seq, out[:, -1].argmax(-1, keepdim=True)], 1)
        return seq
