"""Audit of activation patching and attribution (s20): each test is a value that was silently
wrong, against a reference written by hand (plain hooks, one forward per site; torch.autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.patch_refs import by_position, hand_sweep


class _CapacityMoE(nn.Module):
    """A mixture of experts with a fixed capacity per expert over the batch's tokens, taken in
    the batch's order (GShard/Switch-style code that flattens the tokens): the tokens past an
    expert's capacity are dropped. Copies of the batch in one pass fill the experts in order, so
    the first copy is routed as alone and the later ones lose tokens."""

    def __init__(self, d: int, experts: int = 2, capacity: int = 12) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.capacity = capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().flatten()[: self.capacity]
            out[idx] = expert(flat[idx])
        return x + out.view(b, t, d)


class _MoEBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mix, self.moe = nn.Linear(d, d), _CapacityMoE(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        return self.moe(x + torch.cumsum(self.mix(x), 1) / steps)  # causal mixing


class _CapacityMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(_MoEBlock(16) for _ in range(2))
        self.head = nn.Linear(16, 20)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _logit_diff(out: torch.Tensor) -> torch.Tensor:
    return (out[:, -1, 3] - out[:, -1, 4]).mean()


def test_a_mixture_of_experts_dropping_tokens_past_capacity_across_the_batch_is_exact():
    # Six sites of a block in one pass of 6 copies: the experts filled up with the first copies'
    # tokens and dropped the later copies' ones. Only the first site of the pass was checked
    # against itself alone (routed as alone: it came first), and only by the metric, so sites
    # 2-4 of blocks.0 were silently wrong, by up to 0.63 (values up to 0.26). The first and the
    # last copy of the first pass are now checked, every output tensor of their rows: the layer
    # falls back to one site per pass, with a warning naming it. (The last site's metric, at
    # the last position, happens to be as alone: its logits at positions 0-4 are not.)
    model = _CapacityMoELM().eval()
    g = torch.Generator().manual_seed(0)
    clean, corrupt = (
        torch.randint(0, 20, (1, 6), generator=g),
        torch.randint(0, 20, (1, 6), generator=g),
    )
    names = ["blocks.0", "blocks.1"]
    ref = torch.stack(
        [
            hand_sweep(
                model,
                model.get_submodule(n),
                "output",
                {"input_ids": clean},
                {"input_ids": corrupt},
                _logit_diff,
                by_position,
            )
            for n in names
        ]
    )
    with pytest.warns(
        hs.HookscopeWarning, match=r"at layer 'blocks.0' \(site 5 batched and alone: output differs"
    ):
        got = hs.patch_sweep(model, clean, corrupt, _logit_diff, names)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert (ref[0] - ref[0, 0]).abs().max() > 0.1  # the sites differ: a real check


class _InPlaceResidual(nn.Module):
    """A block written with an in-place residual: the norm's input ``h`` is changed in place
    after the norm read it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.f, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h += self.f(self.norm(h))
        return self.head(torch.tanh(h))


def test_attribution_of_an_input_changed_in_place_later_uses_its_value_at_the_call():
    # attribution_patch kept a reference to the corrupted activation (x.detach()), read after
    # the forward: the in-place residual had changed it, so clean - corrupt was taken against
    # h + f(norm(h)). Position 2 scored +0.65 where (clean - corrupt) . d metric / d act is
    # -0.38 (reference: autograd by hand on a copy of the input taken in the call).
    model = _InPlaceResidual().eval()
    g = torch.Generator().manual_seed(1)
    clean, corrupt = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)

    def metric(y: torch.Tensor) -> torch.Tensor:
        return y[:, -1].sum()

    got = hs.attribution_patch(model, clean, corrupt, metric, ["norm"], at="input")
    kept: dict[str, torch.Tensor] = {}
    h = model.norm.register_forward_pre_hook(lambda m, a: kept.__setitem__("clean", a[0].clone()))
    try:
        with torch.no_grad():
            model(clean)
    finally:
        h.remove()

    def leaf(m: nn.Module, a: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        kept["z"] = a[0].detach().clone().requires_grad_(True)
        return (kept["z"],)

    h = model.norm.register_forward_pre_hook(leaf)
    try:
        value = metric(model(corrupt))
    finally:
        h.remove()
    (grad,) = torch.autograd.grad(value, kept["z"])
    ref = ((kept["clean"] - kept["z"].detach()) * grad).sum(dim=(0, 2))
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got[0], ref, atol=1e-6, rtol=1e-5)


def test_a_float64_model_gets_float64_values():
    # The metric and the attribution products were cast to float32, so a float64 model's sweep
    # and scores were rounded: attribution on a float64 2-layer GPT-2 was 1.2e-8 off autograd by
    # hand in float64 (scores about 0.7), and on this float64 net the sweep rounded to float32 (7
    # digits) against a float64 hand loop. Values in float64 now stay float64 (float32
    # otherwise, as before).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    net = net.double().eval()
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    corrupt = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)

    def metric(y: torch.Tensor) -> torch.Tensor:
        return y[:, -1].sum()

    got = hs.patch_sweep(net, clean, corrupt, metric, ["1"])
    with torch.no_grad():
        act = net[:2](clean)
        ref = []
        for p in range(5):
            h = net[:2](corrupt)
            h[:, p] = act[:, p]
            ref.append(metric(net[2:](h)))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got[0], torch.stack(ref), atol=0, rtol=1e-12)

    scores = hs.attribution_patch(net, clean, corrupt, metric, ["1"])
    h = net[:2](corrupt).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(metric(net[2:](h)), h)
    hand = ((act - h.detach()) * grad).sum(dim=(0, 2))
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores[0], hand, atol=0, rtol=1e-12)
