"""Audit s18b of memory_profile: each row equals a hand count of what autograd saves."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs


def _hand_count(model: nn.Module, run) -> dict[str | None, int]:
    """Bytes of each unique non-parameter storage saved for backward, by the innermost module
    running when it was first saved (``None``: outside the model's call), counted with plain
    hooks and ``saved_tensors_hooks``."""
    stack: list[str] = []

    def push(name: str):
        def hook(module, args) -> None:
            stack.append(name)

        return hook

    def pop(module, args, output) -> None:
        stack.pop()

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(push(name)))
        handles.append(m.register_forward_hook(pop, always_call=True))
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    first: dict[int, tuple[str | None, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in own and st.data_ptr() not in first:
            first[st.data_ptr()] = (stack[-1] if stack else None, st.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    out: dict[str | None, int] = {}
    for owner, n in first.values():
        out[owner] = out.get(owner, 0) + n
    return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))  # tanh: the root's own operation


def test_what_the_loss_saves_is_charged_to_no_module():
    """A cross-entropy loss keeps its log-probabilities (and the targets): those bytes were
    charged to the model's root as saved by its own operations (1540 of its 1796 bytes here),
    silently; they are the profile's loss_saved_bytes, in no row."""
    net = Net()
    x, y = torch.randn(32, 8), torch.randint(0, 10, (32,))

    def loss_fn(out):
        return F.cross_entropy(out, y)

    prof = hs.memory_profile(net, x, loss_fn=loss_fn)
    want = _hand_count(net, lambda: loss_fn(net(x)).backward())
    net.zero_grad(set_to_none=True)
    assert want[None] > 0 and want[""] > 0  # the loss and the root's tanh both save
    for row in prof:
        assert row.saved_bytes == want.get(row.name, 0), (row.name, row.saved_bytes)
    assert prof.loss_saved_bytes == want[None]
    assert prof.total_saved_bytes == sum(want.values())
    assert prof.to_dict()["loss_saved_bytes"] == want[None]
    assert "by the loss, after the model" in str(prof)
    # the default loss (a sum) saves nothing
    assert hs.memory_profile(net, x).loss_saved_bytes == 0
