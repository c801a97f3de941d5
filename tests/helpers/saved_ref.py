"""The independent count of what autograd saves for backward, which ``hs.memory_profile`` must
equal (tests) and which measures a checkpointing plan's real drop (benchmarks)."""

from __future__ import annotations

import torch
import torch.nn as nn


def reference_saved(model: nn.Module, run) -> int:
    """Bytes of the unique storages autograd saves in ``run()`` (forward + backward), parameters and
    buffers apart: the independent count the profile must equal."""
    own = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())
