"""hookscope's demo language model: a two-layer Llama (Hugging Face Transformers) trained on random
token spans that repeat, so that it forms induction heads (Olsson et al., 2022): a layer-0
previous-token head and layer-1 heads that attend from a repeated token to the token after its
earlier occurrence and copy it. Its weights (about 250 KiB) ship inside the package.

The vocabulary is 64 token ids without text: ``0`` is the beginning-of-sequence token, ``1..63``
are the tokens of the spans. :func:`make_induction_prompts` draws prompts (``BOS, span, span``)
and corrupted twins whose first span is replaced, for patching.

Regenerate the weights (deterministic for a fixed seed and thread count; about a minute on one
CPU core)::

    python -m hookscope.demo._lm train          # writes src/hookscope/demo/demo_lm.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "BOS",
    "MAX_SPAN",
    "VOCAB_SIZE",
    "InductionPrompts",
    "load_demo_lm",
    "make_induction_prompts",
    "save_demo_lm",
    "train_demo_lm",
]

LM_WEIGHTS_PATH = Path(__file__).with_name("demo_lm.pt")
_FORMAT = 1
#: Number of token ids (``0`` is :data:`BOS`).
VOCAB_SIZE = 64
#: The beginning-of-sequence token id every prompt starts with.
BOS = 0
_CONTEXT = 48  # max_position_embeddings: the longest sequence trained on
#: The longest span :func:`make_induction_prompts` draws (``BOS`` + two copies fit the context).
MAX_SPAN = (_CONTEXT - 1) // 2
# training data: a random prefix of 0..8 tokens, then a span of 4..20 tokens and its repeat
_PREFIX, _SPAN = 8, (4, 20)
_ARCH: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": _CONTEXT,
    "tie_word_embeddings": True,
    "bos_token_id": BOS,
    "eos_token_id": None,
    "pad_token_id": None,
}


def _new_model(arch: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # eager attention: the attention probabilities come back with output_attentions=True
    config = LlamaConfig(**arch, attn_implementation="eager")
    return LlamaForCausalLM(config)


@dataclass(frozen=True)
class InductionPrompts:
    """Prompts whose second half repeats the first, and corrupted twins, for patching.

    Attributes:
        clean: ``(n, 1 + 2 * length)`` int64: ``BOS``, a span of ``length`` distinct random
            tokens, the same span again. From the second copy on, an induction head predicts
            each next token: it is the token after the current one's earlier occurrence.
        corrupted: the same with the first span replaced by other tokens (each one different
            from the clean token at its position); the second span is unchanged, so nothing
            earlier tells what comes next.
        length: the span length.
        seed: the seed it was drawn from.
    """

    clean: torch.Tensor
    corrupted: torch.Tensor
    length: int
    seed: int

    @property
    def positions(self) -> slice:
        """The positions of the second copy whose next token the first copy gives:
        ``length + 1 .. 2 * length - 1`` (a slice of the sequence dimension)."""
        return slice(self.length + 1, 2 * self.length)

    @property
    def targets(self) -> torch.Tensor:
        """``(n, length - 1)``: the clean next token at each of :attr:`positions`."""
        return self.clean[:, self.length + 2 :]


def make_induction_prompts(n: int, length: int = 10, *, seed: int = 0) -> InductionPrompts:
    """Draw ``n`` repeated-span prompts for :func:`load_demo_lm` (the same seed, the same prompts).

    Args:
        n: number of prompts (rows).
        length: tokens per span, ``2..MAX_SPAN`` (23); a prompt has ``1 + 2 * length`` tokens.
        seed: any non-negative integer.

    Example:
        >>> import torch, hookscope as hs
        >>> p = hs.make_induction_prompts(2, 5, seed=1)
        >>> p.clean.shape, bool((p.clean[:, 1:6] == p.clean[:, 6:]).all())
        (torch.Size([2, 11]), True)
        >>> bool((p.corrupted[:, 1:6] != p.clean[:, 1:6]).all()), bool((p.corrupted[:, 6:] == p.clean[:, 6:]).all())
        (True, True)
        >>> p.targets.shape, p.clean[0, p.positions].shape
        (torch.Size([2, 4]), torch.Size([4]))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"make_induction_prompts: n must be an int >= 1, got {n!r}")
    if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= MAX_SPAN:
        raise ValueError(
            f"make_induction_prompts: length must be an int in 2..{MAX_SPAN} (the model's "
            f"context is {_CONTEXT} tokens), got {length!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"make_induction_prompts: seed must be an int >= 0, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    k = VOCAB_SIZE - 1
    span = torch.stack([torch.randperm(k, generator=g)[:length] for _ in range(n)]) + 1
    # a per-row relabelling of the tokens: distinct tokens stay distinct, none keeps its id
    shift = torch.randint(1, k, (n, 1), generator=g)
    other = (span - 1 + shift) % k + 1
    bos = torch.full((n, 1), BOS, dtype=torch.long)
    return InductionPrompts(
        clean=torch.cat([bos, span, span], 1),
        corrupted=torch.cat([bos, other, span], 1),
        length=length,
        seed=seed,
    )


def _training_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, int]:
    """``BOS``, a random prefix, a random span and its repeat (one span length per batch, so
    no fixed offset solves it); returns the tokens and the first position of the repeat."""
    length = int(torch.randint(_SPAN[0], _SPAN[1] + 1, (1,), generator=g))
    prefix = int(torch.randint(0, _PREFIX + 1, (1,), generator=g))
    x = torch.randint(1, VOCAB_SIZE, (n, 1 + prefix + length), generator=g)
    x[:, 0] = BOS
    return torch.cat([x, x[:, 1 + prefix :]], 1), 1 + prefix + length


def train_demo_lm(
    *,
    steps: int = 800,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    log: Callable[[str], Any] | None = print,
) -> nn.Module:
    """Train a fresh demo language model (a ``LlamaForCausalLM``) and return it in eval mode.

    The loss is the next-token cross-entropy on the repeated span only (the rest is random).
    Deterministic for a given seed and thread count on the CPU: two runs give the same weights.
    The defaults (about a minute on one core) form induction heads; ``log`` gets a line every
    100 steps (``None``: quiet).

    Example:
        >>> from hookscope.demo import train_demo_lm
        >>> model = train_demo_lm(steps=2, log=None)
        >>> type(model).__name__, model.training
        ('LlamaForCausalLM', False)
    """
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(seed)
        model = _new_model(_ARCH)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm, decay = 50, int(0.7 * steps)  # warm up, hold, then decay linearly to a tenth
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min((s + 1) / warm, 1.0, 1.0 - 0.9 * max(0, s - decay) / max(1, steps - decay)),
    )
    g = torch.Generator().manual_seed(seed + 1)
    model.train()
    t0, total = time.perf_counter(), 0.0
    for step in range(steps):
        x, start = _training_batch(g, batch_size)
        logits = model(input_ids=x).logits[:, start:-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), x[:, start + 1 :].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        total += float(loss.detach())
        if log and ((step + 1) % 100 == 0 or step + 1 == steps):
            n = (step % 100) + 1
            log(f"step {step + 1}/{steps}: loss {total / n:.4f}  ({time.perf_counter() - t0:.1f}s)")
            total = 0.0
    return model.eval()


def save_demo_lm(model: nn.Module, path: str | Path = LM_WEIGHTS_PATH) -> Path:
    """Write ``model``'s weights (float32) in the format :func:`load_demo_lm` reads."""
    blob = {
        "format": _FORMAT,
        "arch": dict(_ARCH),
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    path = Path(path)
    torch.save(blob, path)
    return path


def load_demo_lm(weights: str | Path | None = None) -> nn.Module:
    """The trained demo language model, a Transformers ``LlamaForCausalLM`` in eval mode, from
    the weights shipped inside the package (no download; needs ``transformers``).

    Two layers (``model.layers.0``, ``model.layers.1``), four heads each, 64 token ids, a
    48-token context. Prompts come from :func:`make_induction_prompts`.

    Example:
        >>> import torch, hookscope as hs
        >>> model = hs.load_demo_lm()
        >>> p = hs.make_induction_prompts(4, 10, seed=0)
        >>> with torch.no_grad():
        ...     pred = model(p.clean).logits[:, p.positions].argmax(-1)
        >>> bool((pred == p.targets).all())  # it continues every repeated span
        True
    """
    path = Path(weights) if weights is not None else LM_WEIGHTS_PATH
    if not path.is_file():
        raise FileNotFoundError(
            f"demo LM weights {str(path)!r} are missing; run 'python -m hookscope.demo._lm train'"
        )
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
        raise ValueError(f"{str(path)!r} is not a hookscope demo LM file (format {_FORMAT})")
    model = _new_model(blob["arch"])
    model.load_state_dict(blob["state_dict"])
    return model.eval()


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hookscope.demo._lm", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the demo language model and write its weights")
    t.add_argument("--out", default=str(LM_WEIGHTS_PATH), help="weights file to write")
    t.add_argument("--steps", type=int, default=800)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1, help="CPU threads (fixed for reproducibility)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    model = train_demo_lm(steps=args.steps, seed=args.seed)
    prompts = make_induction_prompts(256, 12, seed=12345)
    with torch.no_grad():
        pred = model(prompts.clean).logits[:, prompts.positions].argmax(-1)
    print(f"induction accuracy (256 fresh prompts): {float((pred == prompts.targets).float().mean()):.4f}")  # fmt: skip
    out = save_demo_lm(model, args.out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
