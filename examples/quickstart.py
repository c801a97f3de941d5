"""hookscope quick start: the core features on a small CNN, printing what they see.

.venv/bin/python examples/quickstart.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)  # used twice, and in place: two hook pitfalls at once
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def main() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(2, 3, 16, 16)
    y = torch.tensor([1, 3])

    print("1. find layers by name, glob, type or predicate")
    print("   ", list(hs.find(model, "conv*", nn.Linear)))

    print("\n2. trace: every call as it happens")
    with hs.trace(model):
        model(x)

    print("\n3. capture outputs and gradients (every call of the reused ReLU is kept)")
    with hs.capture(model, ["conv2", "relu", "fc"], grads=True) as cap:
        F.cross_entropy(model(x), y).backward()
    for call in cap.calls("relu"):
        print(
            f"    relu call {call.index}: output {tuple(call.output.shape)}, grad norm {call.grad.norm():.4f}"
        )
    print(
        f"    conv2 output mean {cap['conv2'].mean():+.4f}, grad w.r.t. it {tuple(cap.grads['conv2'].shape)}"
    )

    print("\n4. FeatureExtractor stops after the last layer it needs")
    feats = hs.FeatureExtractor(model, ["conv1", "pool"])(x)
    print("   ", {k: tuple(v.shape) for k, v in feats.items()})

    print("\n5. edit activations: ablate channels 0-3 of conv2, see the logits move")
    with torch.no_grad():
        before = model(x)
        with hs.edit(model, {"conv2": hs.ops.ablate([0, 1, 2, 3])}):
            after = model(x)
    print(f"    max |Δlogit| = {(after - before).abs().max():.4f}")

    print("\n6. edit gradients: clamp conv1's output gradient at 0, zero fc.bias's gradient")
    model.zero_grad()
    with hs.edit_grads(model, {"conv1": hs.ops.clamp(min=0), "fc.bias": hs.ops.zero()}):
        F.cross_entropy(model(x), y).backward()
    print(f"    fc.bias.grad = {model.fc.bias.grad.tolist()}")

    print("\n7. gradient clipping by hooks, until the handle is removed")
    model.zero_grad()
    handle = hs.clip_grads(model, value=1e-3)
    F.cross_entropy(model(x), y).backward()
    handle.remove()
    print(f"    largest |grad| = {max(p.grad.abs().max().item() for p in model.parameters()):.4g}")

    print("\n8. nothing left behind:", hs.hooks_on(model))


if __name__ == "__main__":
    main()
