"""Activation patching: hookscope's batched sweeps against TransformerLens's helpers.

A random-weight 6-layer GPT-2 (d_model 256, 8 heads), 32 positions, batch 4, CPU, one thread,
eager attention on both sides. TransformerLens runs on its ``TransformerBridge`` around a copy of
the same model (same weights). Contenders are interleaved in one run (``_timing.interleaved``).

Prompts: ``ioi`` (clean and corrupted differ in one name, at position 24 of 32, as in IOI) or
``random`` (every position differs: no site is skipped). Peak memory of a sweep under a budget is
the peak of live CPU tensor bytes from the profiler's allocation events.

Run: ``.venv/bin/python benchmarks/bench_patching.py [--prompts ioi|random] [--vocab N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's per-site progress bars
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import hookscope as hs  # noqa: E402
from _timing import interleaved, table  # noqa: E402

B, T, LAYERS = 4, 32, 6


def build(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=256,
        n_layer=LAYERS,
        n_head=8,
        bos_token_id=2,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def prompts(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, 45, (B, T), generator=g)
    if kind == "random":
        return clean, torch.randint(3, 45, (B, T), generator=g)
    corrupt = clean.clone()
    corrupt[:, 24] = torch.where(clean[:, 24] == 7, 8, 7)  # one name swapped
    return clean, corrupt


def metric(out):
    lg = out.logits if hasattr(out, "logits") else out
    return (lg[:, -1, 7] - lg[:, -1, 8]).mean()


def peak_memory(model, clean, corrupt, attn, budget: int) -> tuple[int, float]:
    """Peak bytes of CPU tensors allocated during a head x position sweep under ``budget`` (the
    running sum of every op's own allocations and of the frees, in time order, from the
    profiler), and the seconds it took."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hs.patch_sweep(
            model, clean, corrupt, metric, attn, over=("position", "head"), max_bytes=budget
        )
    took = time.perf_counter() - t0
    cur = peak = 0  # each op's own allocations net of its own frees, and the later frees
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak, took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", choices=["ioi", "random"], default="ioi")
    ap.add_argument("--vocab", type=int, default=45)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["resid", "heads", "attribution", "memory"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformer_lens.patching as tlp

    from helpers.lm import tl_bridge, word_tokenizer

    model = build(args.vocab)
    bridge = tl_bridge(model, word_tokenizer())
    clean, corrupt = prompts(args.prompts)
    _, cache = bridge.run_with_cache(clean)
    blocks, attn = hs.blocks(model), hs.blocks(model, "attn")
    hp = ("position", "head")

    def bare():
        with torch.no_grad():
            model(corrupt, use_cache=False)

    def fwd_bwd():
        metric(model(clean, use_cache=False)).backward()
        model.zero_grad(set_to_none=True)

    rows = []
    print(f"prompts={args.prompts} vocab={args.vocab} load={os.getloadavg()[0]:.1f}", flush=True)
    if args.only in (None, "resid"):
        got = hs.patch_sweep(model, clean, corrupt, metric, blocks, at="input")
        ref = tlp.get_act_patch_resid_pre(bridge, corrupt, cache, metric)
        err = (got - ref).abs().max().item()
        t = interleaved(
            {
                "bare": bare,
                "tl": lambda: tlp.get_act_patch_resid_pre(bridge, corrupt, cache, metric),
                "hs": lambda: hs.patch_sweep(model, clean, corrupt, metric, blocks, at="input"),
            },
            rounds=args.rounds,
            warmup=1,
        )
        rows.append(["resid_pre, layers x positions", LAYERS * T, t, err])
        print(rows[-1], flush=True)
    if args.only in (None, "heads"):
        got = hs.patch_sweep(model, clean, corrupt, metric, attn, over=hp)
        ref = tlp.get_act_patch_attn_head_out_by_pos(bridge, corrupt, cache, metric)
        err = (got - ref).abs().max().item()
        t = interleaved(
            {
                "bare": bare,
                "tl": lambda: tlp.get_act_patch_attn_head_out_by_pos(
                    bridge, corrupt, cache, metric
                ),
                "hs": lambda: hs.patch_sweep(model, clean, corrupt, metric, attn, over=hp),
            },
            rounds=max(1, args.rounds - 1),
            warmup=0,
        )
        rows.append(["head out, layers x positions x heads", LAYERS * T * 8, t, err])
        print(rows[-1], flush=True)
    if rows:
        print(
            table(
                [
                    "sweep",
                    "sites",
                    "bare fwd 4 rows (ms)",
                    "TransformerLens (s)",
                    "hookscope (s)",
                    "TL / hookscope",
                    "max |diff| vs TL",
                ],
                [
                    [
                        r[0],
                        r[1],
                        f"{r[2]['bare'] * 1e3:.1f}",
                        f"{r[2]['tl']:.2f}",
                        f"{r[2]['hs']:.2f}",
                        f"{r[2]['tl'] / r[2]['hs']:.1f}x",
                        f"{r[3]:.1e}",
                    ]
                    for r in rows
                ],
            ),
            flush=True,
        )
    if args.only in (None, "attribution"):
        t = interleaved(
            {
                "fwd_bwd": fwd_bwd,
                "attr": lambda: hs.attribution_patch(model, clean, corrupt, metric, attn, over=hp),
                "attr_resid": lambda: hs.attribution_patch(
                    model, clean, corrupt, metric, blocks, at="input"
                ),
            },
            rounds=args.rounds * 3,
            warmup=1,
        )
        print(
            table(
                ["attribution patching", "one clean fwd+bwd (ms)", "hookscope (ms)", "ratio"],
                [
                    [
                        "heads x positions (1536 sites)",
                        f"{t['fwd_bwd'] * 1e3:.1f}",
                        f"{t['attr'] * 1e3:.1f}",
                        f"{t['attr'] / t['fwd_bwd']:.2f}x",
                    ],
                    [
                        "resid_pre x positions (192 sites)",
                        f"{t['fwd_bwd'] * 1e3:.1f}",
                        f"{t['attr_resid'] * 1e3:.1f}",
                        f"{t['attr_resid'] / t['fwd_bwd']:.2f}x",
                    ],
                ],
            ),
            flush=True,
        )
    if args.only in (None, "memory"):
        mem = []
        for budget in (4 << 20, 16 << 20, 64 << 20, 256 << 20):
            peak, took = peak_memory(model, clean, corrupt, attn, budget)
            within = "yes" if peak <= budget else "NO"
            mem.append([f"{budget >> 20} MiB", f"{peak / 2**20:.1f} MiB", within, f"{took:.1f}"])
        head = ["max_bytes", "peak live tensors", "within", "seconds (profiled)"]
        print(table(head, mem), flush=True)


if __name__ == "__main__":
    main()
