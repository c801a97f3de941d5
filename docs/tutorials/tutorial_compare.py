"""
My compiled model's loss differs: find the layer
================================================

A model gives one loss eagerly and another under ``torch.compile`` (or in bf16, or after a
library upgrade, or in your port of a reference model). Every layer after the first wrong one
differs too, so a per-layer diff shows a wall of differences. ``hs.compare`` runs both, then
replays each module of the second run **on the first run's own inputs to it**: the error a module
adds by itself. The module whose own computation is wrong is the *culprit*.

This page compiles with the ``eager`` backend (Dynamo only) to stay quick on a CPU; ``inductor``
works the same way.
"""

# %%
import copy

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

import hookscope as hs

torch.manual_seed(0)


class Norm(nn.Module):
    """An RMS norm with a bug that exists only in the compiled program (as a wrong decomposition
    or a custom kernel registered for compile would give)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = 0.5 if torch.compiler.is_compiling() else 1e-6
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = Norm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


model = nn.Sequential(nn.Linear(16, 32), *[Block(32) for _ in range(4)], nn.Linear(32, 10))
x = torch.randn(8, 16)
target = torch.randint(0, 10, (8,))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), target)


compiled = torch.compile(copy.deepcopy(model), backend="eager")
print("eager loss   ", loss_fn(model(x)).item())
print("compiled loss", loss_fn(compiled(x)).item())

# %%
# A per-layer diff: a wall of differences
# ---------------------------------------
# ``report.rows`` has one row per module call; ``error`` is the compiled run's output against the
# eager run's. From the first block on, everything differs: where the error shows, not where it
# is made.
report = hs.compare(model, compiled, x, loss_fn=loss_fn)
for row in report.rows:
    if row.depth == 1:
        print(f"{row.label:4} {row.kind:10} error {row.error:.1e}")

# %%
# The culprit
# -----------
# Each row also has a ``local_error`` (the compiled model's module run on the eager run's inputs
# to it, the modules it calls returning the eager run's outputs) and, for a compiled model, a
# ``compile_error`` (the compiled output of the module against the same module run eagerly on
# the inputs the compiled run gave it). Only the norm of block 1 adds error of its own; all four
# norms share the bug, so all four are listed in ``culprits``, the first one in ``culprit``.
print("culprit:", report.culprit)
print("culprits:", report.culprits)
print("first divergent:", report.first_divergent)
print(report.row("1.norm"))

# %%
# The whole table, and the plot: errors grow along the model, the local errors stay at zero
# except where the bug is.
print(report)
fig, ax = plt.subplots(figsize=(9, 3.5))
report.plot(ax=ax)
fig.tight_layout()

# %%
# Fault-free pairs name no culprit
# --------------------------------
# The tolerance of each module comes from the two dtypes (``4 * eps(dtype) + 16 * eps(float32) *
# sqrt(K)``, ``K`` its largest reduction), so a bf16 copy, which differs everywhere by rounding,
# names nothing.
bf16 = hs.compare(model, copy.deepcopy(model).to(torch.bfloat16), x, loss_fn=loss_fn)
print("bf16 copy culprit:", bf16.culprit, "| largest local error / tolerance:",
      round(max(r.local_error / r.tol for r in bf16.rows), 2))  # fmt: skip

# %%
# Across processes
# ----------------
# ``hs.record`` writes what ``hs.compare`` needs of a run to a folder, as the run goes; compare
# it later with a live model (same verdicts) or with another record (errors and first
# divergence), in Python or with ``hookscope compare FOLDER_A FOLDER_B``.
import tempfile  # noqa: E402

folder = tempfile.mkdtemp()
with hs.record(model, folder):
    loss_fn(model(x)).backward()
model.zero_grad(set_to_none=True)
print("from the record:", hs.compare(folder, compiled, x, loss_fn=loss_fn).culprit)
