"""What a model's ``forward`` accepts, looked up once through ``torch.compile`` wrappers.

Products pass optional arguments (``use_cache=False``, ``attention_mask``, ``output_hidden_states``)
only where the model takes them; this is the one rule for deciding that.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from ._compiled import strip_compiled

__all__ = ["accepts", "forward_parameters"]


def forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters of the eager ``model.forward`` (a compiled wrapper is looked through);
    empty when the signature cannot be read (a C function, a ``functools.partial`` of one).

    >>> list(forward_parameters(nn.Linear(2, 2)))
    ['input']
    """
    try:
        return dict(inspect.signature(strip_compiled(model).forward).parameters)
    except (TypeError, ValueError):
        return {}


def accepts(model: nn.Module, name: str, *, through_kwargs: bool = False) -> bool:
    """Whether ``model``'s forward takes an argument called ``name``: a parameter of that name,
    or, with ``through_kwargs=True``, any ``**kwargs`` (which may take it; say so only where an
    unknown keyword is harmless or the caller checks the result).

    >>> class Net(nn.Module):
    ...     def forward(self, x, mask=None, **kwargs):
    ...         return x
    >>> accepts(Net(), "mask"), accepts(Net(), "use_cache"), accepts(Net(), "use_cache", through_kwargs=True)
    (True, False, True)
    """
    params = forward_parameters(model)
    if name in params and params[name].kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ):
        return True
    return through_kwargs and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
