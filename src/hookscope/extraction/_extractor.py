"""``FeatureExtractor``: an ``nn.Module`` returning ``{layer: output}``, stopping early."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..core._capture import Capture, _Recorder
from ..core._errors import HookscopeError, LayerNotRunError
from ..core._scope import check_model, stale_names
from ..core._select import resolve

__all__ = ["FeatureExtractor"]


class FeatureExtractor(nn.Module):
    """Wrap ``model`` so that calling it returns ``{layer: output}`` for the selected layers.

    The forward pass stops as soon as every selected layer has run, so the rest of the network
    costs nothing. Hooks exist only during a call; the model carries none in between. Outputs keep
    their autograd graph (``detach=False`` by default), so the extractor can be trained through.

    Each value is what the layer returned, even when the model changes that tensor in place
    before the last selected layer runs (``out += identity`` after a residual block's last norm):
    outputs are copied (``clone=True``), except the one whose call ends the forward pass, which
    nothing can change any more. ``clone=False`` returns the model's own tensors (zero-copy) and
    raises an :class:`InPlaceModifiedWarning` for each one the model changed in place.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> fx = hs.FeatureExtractor(net, ["1"])
        >>> {k: tuple(v.shape) for k, v in fx(torch.zeros(5, 2)).items()}
        {'1': (5, 3)}
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Any,
        *,
        detach: bool = False,
        clone: bool = True,
        stop: bool = True,
    ) -> None:
        super().__init__()
        check_model(model)
        self.model = model
        self._named = resolve(model, layers)
        self.layers: list[str] = list(self._named)
        self.detach = detach
        self.clone = clone
        self.stop = stop

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if stale_names(self.model, self._named):
            # a layer replaced since the extractor was made (model.fc = nn.Linear(...)): its
            # hooks would sit on the old module, which the model no longer calls; the layers are
            # named, so the extractor takes the module each name holds now
            self._named = resolve(self.model, self.layers)
        rec = _Recorder(
            inputs=False, grads=False, detach=self.detach, clone=self.clone, to=None, keep="last"
        )
        # (checked above, once per call: the scope, open for this call alone, tracks nothing)
        cap = Capture(self.model, self._named, rec, stop=self.stop, track=False)
        with cap:
            self.model(*args, **kwargs)
        missing = cap.missing
        if missing:
            raise LayerNotRunError(
                f"FeatureExtractor: layer(s) {', '.join(map(repr, missing))} of {type(self.model).__name__} "
                "never ran during this forward pass (called via .forward() directly, or not on this input's path)"
            )
        calls = {name: rec.materialize(name)[-1] for name in self.layers}
        again = [name for name, c in calls.items() if c.index > 0]
        if again:  # one output per layer: which call's? (stop=True and False gave different ones)
            raise HookscopeError(
                f"FeatureExtractor: layer(s) {', '.join(map(repr, again))} of "
                f"{type(self.model).__name__} ran more than once in this forward pass (a module "
                "called again, e.g. shared weights), and the extractor returns one output per "
                "layer; use hs.capture(model, layer) for every call (cap.calls(layer))"
            )
        # .output: a value kept without a copy that the model changed in place is reported
        return {name: c.output for name, c in calls.items()}

    def extra_repr(self) -> str:
        return f"layers={self.layers}, stop={self.stop}, clone={self.clone}"
