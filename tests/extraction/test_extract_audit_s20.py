"""Audit (s20) of extract for silently wrong features: a layer returning several tensors (an FPN's
dict of levels: only the first was saved, without a word) and a run made inside
``torch.autocast`` (not in the fingerprint: a finished float32 folder was returned, or an
interrupted one resumed, as the autocast run's). Values are checked against hand hooks run in the
same batches."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import hookscope as hs
from hookscope.extraction import ExtractError


class _Pyramid(nn.Module):
    """A backbone returning a dict of levels (torchvision's FPN), a head returning ``(out, None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.body(x)
        t = feats["0"].flatten(2).transpose(1, 2)
        out, _ = self.attn(t, t, t, need_weights=False)
        return out.mean() + feats["1"].mean()


class _Body(nn.Module):
    def __init__(self, owner: _Pyramid) -> None:
        super().__init__()
        self.stem, self.down = owner.stem, owner.down

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        a = self.stem(x)
        return OrderedDict([("0", a), ("1", self.down(a))])


def _pyramid() -> _Pyramid:
    torch.manual_seed(0)
    m = _Pyramid()
    m.body = _Body(m)
    return m.eval()


def _hand(model: nn.Module, x: torch.Tensor, layer: str, batch: int) -> dict[str, np.ndarray]:
    """Each tensor of ``layer``'s output, by path, from a hand hook run in the same batches."""
    mod = dict(model.named_modules())[layer]
    rows: dict[str, list[torch.Tensor]] = {}

    def hook(module, args, output):
        for key, t in output.items():
            rows.setdefault(key, []).append(t.clone())

    h = mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch):
                model(x[i : i + batch])
    finally:
        h.remove()
    return {k: torch.cat(v).numpy() for k, v in rows.items()}


def test_a_layer_returning_several_tensors_is_warned_naming_them(tmp_path):
    model, x = _pyramid(), torch.randn(6, 3, 8, 8)
    with pytest.warns(hs.HookscopeWarning) as got:
        feats = hs.extract(
            model, TensorDataset(x), ["body"], tmp_path / "a", batch_size=4, progress=False
        )
    msg = str(got[0].message)
    assert "'body' returns 2 tensors (OrderedDict: '0': (1, 4, 8, 8), '1': (1, 6, 4, 4))" in msg
    assert "saves only the first" in msg and "hs.FeatureExtractor" in msg
    assert got[0].filename == __file__  # the warning points at the call
    ref = _hand(model, x, "body", 4)
    np.testing.assert_array_equal(feats["body"], ref["0"])  # the first tensor, exactly


def test_a_resume_warns_again_and_one_tensor_layers_do_not(tmp_path, recwarn):
    model, x = _pyramid(), torch.randn(6, 3, 8, 8)
    # (out, None) and a plain tensor: nothing is left out, nothing said
    feats = hs.extract(
        model, TensorDataset(x), ["attn", "stem"], tmp_path / "b", batch_size=4, progress=False
    )
    assert not [w for w in recwarn if issubclass(w.category, hs.HookscopeWarning)]
    ref = model.stem(x).detach()
    np.testing.assert_array_equal(feats["stem"], ref.numpy())

    class Stop(Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            if i == 4 and self.stop:
                raise KeyboardInterrupt
            return (x[i],)

    data = Stop()
    data.stop = True
    warned = pytest.warns(hs.HookscopeWarning, match="'body' returns 2 tensors")
    with warned, pytest.raises(KeyboardInterrupt):
        hs.extract(model, data, ["body"], tmp_path / "c", batch_size=4, progress=False)
    data.stop = False
    with pytest.warns(hs.HookscopeWarning, match="'body' returns 2 tensors"):
        feats = hs.extract(model, data, ["body"], tmp_path / "c", batch_size=4, progress=False)
    np.testing.assert_array_equal(feats["body"], _hand(model, x, "body", 4)["0"])


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()


def _eager(model: nn.Module, x: torch.Tensor, batch: int) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model(x[i : i + batch]).float() for i in range(0, len(x), batch)]).numpy()


def test_a_finished_float32_folder_is_not_returned_for_an_autocast_call(tmp_path):
    model, x = _convnet(), torch.randn(8, 3, 12, 12)
    data = TensorDataset(x)
    hs.extract(model, data, ["2"], tmp_path, batch_size=4, progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _eager(model, x, 4)
        with pytest.raises(ExtractError, match=r"autocast \(None there, cpu bfloat16 here\)"):
            hs.extract(model, data, ["2"], tmp_path, batch_size=4, progress=False)
        feats = hs.extract(model, data, ["2"], tmp_path / "ac", batch_size=4, progress=False)
    np.testing.assert_array_equal(feats["2"], ref)  # the autocast run's features, exactly
    assert np.abs(ref - _eager(model, x, 4)).max() > 1e-4  # (which float32's are not)
    # and back without autocast: the autocast folder is not returned either
    with pytest.raises(ExtractError, match=r"autocast \(cpu bfloat16 there, None here\)"):
        hs.extract(model, data, ["2"], tmp_path / "ac", batch_size=4, progress=False)


def test_an_interrupted_run_is_not_resumed_under_autocast(tmp_path):
    model, x = _convnet(), torch.randn(8, 3, 12, 12)

    class Stop(Dataset):
        stop = True

        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            if i == 4 and self.stop:
                raise KeyboardInterrupt
            return (x[i],)

    data = Stop()
    with pytest.raises(KeyboardInterrupt):
        hs.extract(model, data, ["2"], tmp_path, batch_size=4, progress=False)
    data.stop = False
    refused = pytest.raises(ExtractError, match=r"unfinished .* autocast \(None there, cpu bf")
    with torch.autocast("cpu", dtype=torch.bfloat16), refused:
        hs.extract(model, data, ["2"], tmp_path, batch_size=4, progress=False)
    feats = hs.extract(model, data, ["2"], tmp_path, batch_size=4, progress=False)
    np.testing.assert_array_equal(feats["2"], _eager(model, x, 4))
