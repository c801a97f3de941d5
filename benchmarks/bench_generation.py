"""Generation with hookscope: token-aligned capture and steering around ``model.generate()``,
and building a steering vector, against bare PyTorch / transformers and hand-written hooks.

Run: ``python benchmarks/bench_generation.py [--rounds 9] [--tokens 64] [--quick]``.
Greedy generation of ``--tokens`` new tokens (``min_new_tokens`` = ``max_new_tokens``, so every
contender runs the same number of steps) from one 8-token prompt, random-weight GPT-2s, CPU,
1 intra-op thread, eager attention. Contenders are timed interleaved in one run (order rotated
each round), so the ratios share the machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import hookscope as hs
from _timing import samples, table
from helpers.lm import word_tokenizer


def gpt2(n_layer: int, n_embd: int, n_head: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=256,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg).eval()


def _stats(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        stat: {k: (min(v) if stat == "min" else statistics.median(v)) for k, v in runs.items()}
        for stat in ("min", "median")
    }


def _timed(contenders: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds per call from ``_timing.samples`` (interleaved, rotated), and beside them
    each call's CPU seconds of this thread (``<name> cpu``): with one intra-op thread all the
    work runs here, and CPU time does not count the time the shared machine's other processes
    hold the cores, which wall time does."""
    cpu: dict[str, list[float]] = {k: [] for k in contenders}

    def wrap(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            t = time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - t)

        return run

    wall = samples({k: wrap(k, f) for k, f in contenders.items()}, rounds=rounds)
    return {**wall, **{f"{k} cpu": v[-rounds:] for k, v in cpu.items()}}


def generation_rows(name: str, model, tokens: int, rounds: int) -> list[list[object]]:
    ids = torch.randint(
        3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
    )
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    layers = [f"transformer.h.{i}" for i in range(len(model.transformer.h))][:4]
    vec = {layers[len(layers) // 2]: torch.randn(model.config.n_embd)}

    def bare() -> None:
        model.generate(ids, **kw)

    def raw_hooks() -> None:  # what a user writes by hand: a list per layer, no alignment
        store: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
        handles = [
            model.get_submodule(n).register_forward_hook(
                lambda m, a, o, n=n: store[n].append(o.detach().clone())
            )
            for n in layers
        ]
        try:
            model.generate(ids, **kw)
        finally:
            for h in handles:
                h.remove()
        for n in layers:
            torch.cat(store[n], 1)

    def captured() -> None:
        with hs.capture(model, layers, sequence=True) as cap:
            model.generate(ids, **kw)
        for n in layers:
            cap.sequence(n)

    def steered() -> None:
        with hs.steer(model, vec, scale=2.0):
            model.generate(ids, **kw)

    def steered_generated() -> None:
        with hs.steer(model, vec, scale=2.0, positions="generated"):
            model.generate(ids, **kw)

    runs = _timed(
        {
            "bare": bare,
            "raw": raw_hooks,
            "capture": captured,
            "steer": steered,
            "steer-gen": steered_generated,
        },
        rounds=rounds,
    )
    rows = []
    for stat, got in _stats(runs).items():
        for clock in ("wall", "cpu"):
            k = "" if clock == "wall" else " cpu"
            b = got["bare" + k]
            rows.append(
                [name, f"{clock} {stat}", f"{b * 1e3:.1f}", f"{got['raw' + k] / b:.3f}×",
                 f"{got['capture' + k] / b:.3f}×", f"{got['steer' + k] / b:.3f}×",
                 f"{got['steer-gen' + k] / b:.3f}×"]
            )  # fmt: skip
    return rows


def hook_work_rows(model, tokens: int, reps: int = 2000) -> list[list[object]]:
    """The work hookscope adds per generated token, timed on its own (min of 5 runs of ``reps``
    calls, thread CPU time): the hooks called directly on the arguments of a real decode step,
    and ``sequence()`` per token. Free of the load noise that swamps whole-generate ratios."""
    ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    layers = [f"transformer.h.{i}" for i in range(4)]
    seen: list[tuple[dict, torch.Tensor]] = []
    h = model.transformer.h[1].register_forward_hook(
        lambda m, a, o: seen.append(o) if len(seen) < 3 else None
    )
    step_kwargs: list[dict] = []
    h2 = model.register_forward_pre_hook(
        lambda m, a, k: step_kwargs.append(k) if len(step_kwargs) < 3 else None, with_kwargs=True
    )
    try:
        bare = float("inf")
        for _ in range(3):
            t0 = time.thread_time()
            model.generate(ids, **kw)
            bare = min(bare, (time.thread_time() - t0) / tokens)
    finally:
        h.remove()
        h2.remove()
    out, kwargs = seen[2], step_kwargs[2]  # a decode step: one token

    def per_call(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(reps):
                fn()
            best = min(best, (time.thread_time() - t) / reps)
        return best

    with hs.capture(model, layers, sequence=True) as cap:
        model.generate(ids, **kw)
        tracker = cap._tokens
        layer_hook = next(
            f for f in model.transformer.h[1]._forward_hooks.values() if hasattr(f, "entries")
        )
        pre = per_call(lambda: (tracker._pre(model, (), kwargs), tracker.steps.pop()))
        rec = per_call(lambda: (layer_hook(None, (), out), layer_hook.entries.pop()))
    t = time.thread_time()
    for n in layers:
        cap.sequence(n)
    seq = (time.thread_time() - t) / tokens
    vec = torch.randn(model.config.n_embd)
    with hs.steer(model, {"transformer.h.1": vec}) as st:
        steer_hook = next(iter(model.transformer.h[1]._forward_hooks.values()))
        steer = per_call(lambda: steer_hook(None, (), out))
        root_pre = per_call(lambda: st._on_model_call(model, ()))
    cap_total = pre + 4 * rec + seq
    steer_total = root_pre + steer
    us = lambda x: f"{x * 1e6:.1f}"  # noqa: E731
    return [
        ["capture(sequence=True), 4 layers", us(bare), f"tracker {us(pre)} + 4 × layer {us(rec)} + sequence() {us(seq)}",
         us(cap_total), f"{1 + cap_total / bare:.3f}×"],
        ["steer, 1 layer", us(bare), f"model-call check {us(root_pre)} + layer {us(steer)}",
         us(steer_total), f"{1 + steer_total / bare:.3f}×"],
    ]  # fmt: skip


def vector_rows(rounds: int) -> list[list[object]]:
    from steering_vectors import train_steering_vector

    model = gpt2(4, 256, 4, 45)
    tok = word_tokenizer("right")
    words = tok.get_vocab()
    vocab = [w for w in words if not w.startswith("<")]
    g = torch.Generator().manual_seed(1)
    pick = lambda n: " ".join(vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=g))  # noqa: E731
    pairs = [(pick(6 + i % 5), pick(5 + i % 7)) for i in range(32)]
    pos, neg = [p for p, _ in pairs], [n for _, n in pairs]
    layer = "transformer.h.2"
    rows_ids = tok(pos + neg, return_tensors="pt", padding=True)

    def one_forward() -> None:  # the floor: one forward over the 64 padded prompts
        with torch.no_grad():
            model(**rows_ids)

    def ours() -> None:
        hs.steering_vector(model, pos, neg, layer, tokenizer=tok)

    def theirs_32() -> None:
        train_steering_vector(model, tok, pairs, layers=[2], batch_size=32)

    def theirs_1() -> None:
        train_steering_vector(model, tok, pairs, layers=[2])

    runs = _timed(
        {"fwd": one_forward, "ours": ours, "sv32": theirs_32, "sv1": theirs_1}, rounds=rounds
    )
    return [
        ["32 pairs, 4×256 GPT-2, layer 2", f"{clock} {stat}", *(f"{got[c + k] * 1e3:.2f}" for c in ("fwd", "ours", "sv32", "sv1"))]
        for stat, got in _stats(runs).items()
        for clock, k in (("wall", ""), ("cpu", " cpu"))
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="the small model only")
    ap.add_argument("--hook-work", action="store_true", help="only the per-token hook work")
    ap.add_argument("--big-only", action="store_true", help="only the GPT-2-small shape")
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if a.hook_work:
        hrows = hook_work_rows(gpt2(4, 256, 4, 1000), a.tokens)
        print(table(["job", "bare per token", "parts", "hookscope per token", "ratio"], hrows))
        return
    models = [("GPT-2 4×256 (vocab 1000)", lambda: gpt2(4, 256, 4, 1000))]
    if not a.quick:
        models.append(("GPT-2 small shape 12×768 (vocab 50257)", lambda: gpt2(12, 768, 12, 50257)))
    if a.big_only:
        models = models[1:]
    rows: list[list[object]] = []
    for name, make in models:
        rows += generation_rows(name, make(), a.tokens, a.rounds)
        print(rows[-4:], flush=True)
    print(f"\ngreedy generation of {a.tokens} tokens, 4 layers captured / 1 layer steered")
    print(
        table(
            ["model", "clock, of rounds", "bare generate (ms)", "raw hooks, 4 layers", "hs.capture(sequence=True) 4 layers + sequence()",
             "hs.steer all", "hs.steer generated"],
            rows,
        )
    )  # fmt: skip
    if a.big_only:
        return
    hrows = hook_work_rows(gpt2(4, 256, 4, 1000), a.tokens)
    print("\nhookscope's own work per generated token (GPT-2 4×256, CPU time, µs)")
    print(
        table(
            ["job", "bare generate per token", "parts", "hookscope per token", "bare + hookscope"],
            hrows,
        )
    )
    vrows = vector_rows(a.rounds)
    print("\nsteering vector from 32 prompt pairs (ms)")
    print(
        table(
            ["job", "clock, of rounds", "one forward (64 rows)", "hs.steering_vector", "steering-vectors batch 32",
             "steering-vectors batch 1"],
            vrows,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
