"""Activation-patching references written by hand with plain PyTorch hooks: one forward per
site, no hookscope."""

from __future__ import annotations

import torch

__all__ = ["by_head", "by_pos_head", "by_position", "hand_sweep", "hidden_of"]


def hidden_of(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return "arg", args[0]
    return "kw", kwargs["hidden_states"]


def _replace(args, kwargs, where, new):
    if where == "arg":
        return (new, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": new}


def hand_sweep(model, module, kind, clean, corrupt, metric, cut):
    """One forward per site. ``cut(act, i)`` -> boolean mask of site ``i`` over ``act``'s
    non-batch dims (for a head: the head's features); ``kind`` 'input' or 'output'."""
    store = {}

    def keep_in(m, a, k):
        store["x"] = hidden_of(a, k)[1].clone()

    def keep_out(m, a, o):
        store["x"] = (o[0] if isinstance(o, tuple) else o).clone()

    if kind == "input":
        h = module.register_forward_pre_hook(keep_in, with_kwargs=True)
    else:
        h = module.register_forward_hook(keep_out)
    try:
        with torch.no_grad():
            model(**clean)
    finally:
        h.remove()
    src = store["x"]
    n = cut(src, None)
    out = []
    for i in range(n):
        mask = cut(src, i)

        def pre(m, a, k, mask=mask):
            where, x = hidden_of(a, k)
            return _replace(a, k, where, torch.where(mask, src, x))

        def post(m, a, o, mask=mask):
            if isinstance(o, tuple):
                return (torch.where(mask, src, o[0]), *o[1:])
            return torch.where(mask, src, o)

        if kind == "input":
            h = module.register_forward_pre_hook(pre, with_kwargs=True)
        else:
            h = module.register_forward_hook(post)
        try:
            with torch.no_grad():
                out.append(float(metric(model(**corrupt))))
        finally:
            h.remove()
    return torch.tensor(out)


def by_position(act, i):
    if i is None:
        return act.shape[1]
    m = torch.zeros(act.shape[1:], dtype=torch.bool)
    m[i] = True
    return m


def by_head(heads):
    def cut(act, i):
        if i is None:
            return heads
        d = act.shape[-1] // heads
        m = torch.zeros(act.shape[1:], dtype=torch.bool)
        m[..., i * d : (i + 1) * d] = True
        return m

    return cut


def by_pos_head(heads):
    def cut(act, i):
        if i is None:
            return act.shape[1] * heads
        p, h = divmod(i, heads)
        d = act.shape[-1] // heads
        m = torch.zeros(act.shape[1:], dtype=torch.bool)
        m[p, h * d : (h + 1) * d] = True
        return m

    return cut
