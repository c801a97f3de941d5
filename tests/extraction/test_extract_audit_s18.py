"""Audit (s18) of extract / load_features for silently wrong or lost features: layers of different
dtypes in one run, float16 overflow, files damaged on disk, and changes between a run and its
resume that the fingerprint did not see. Every value is checked against a plain forward pass."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import hookscope as hs


class _Interrupting(Dataset):
    """Raises KeyboardInterrupt at index ``at`` (Ctrl-C mid-run)."""

    def __init__(self, base: Dataset, at: int) -> None:
        self.base, self.at = base, at

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i == self.at:
            raise KeyboardInterrupt
        return self.base[i]


class _ThreeKinds(nn.Module):
    """A real layer, a complex one (an FFT) and an int64 one with values float64 cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.spec, self.code = nn.Linear(4, 4), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.spec(torch.fft.fft(y))
        self.code((y * 1e3).long() + 2**60 + 1)
        return y


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_layers_of_different_dtypes_keep_each_its_own(tmp_path, dtype):
    """Layers of different dtypes in one run were all stored as float64 (np.dtype(None)): the
    complex layer lost its imaginary part (a numpy warning from the writer thread), the int64
    one was rounded, while the manifest claimed complex64 and int64. Each file now holds its
    layer's dtype and the exact values of a plain forward."""
    torch.manual_seed(0)
    model = _ThreeKinds()
    x = torch.randn(6, 4)
    with torch.no_grad():  # batch by batch, as extracted (a GEMM's last bits can depend on
        # the number of rows on some CPUs)
        y = torch.cat([model.lin(x[:4]), model.lin(x[4:])])
        want = {"lin": y, "spec": torch.fft.fft(y), "code": (y * 1e3).long() + 2**60 + 1}
    feats = hs.extract(
        model, TensorDataset(x), ["lin", "spec", "code"], tmp_path, batch_size=4, dtype=dtype,
        progress=False,
    )  # fmt: skip
    # dtype=float32 casts the int64 layer as asked; the complex one stays complex (complex64)
    kinds = {
        "lin": np.float32,
        "spec": np.complex64,
        "code": np.int64 if dtype is None else np.float32,
    }
    for layer, kind in kinds.items():
        got = np.load(tmp_path / feats.manifest["files"][layer])
        assert got.dtype == kind, layer
        assert feats.manifest["dtypes"][layer] == np.dtype(kind).name
        np.testing.assert_array_equal(got, want[layer].numpy().astype(kind), err_msg=layer)


class _Loud(nn.Module):
    """Rows 0-3 stay within float16's range; rows 4-5 reach about 1e5; the second output holds
    the model's own inf (float32 overflow in the forward itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.inf = nn.Linear(4, 4), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.inf(y * 1e38 * 1e38)
        return y


def test_float16_overflow_is_refused_naming_the_layer(tmp_path):
    """dtype=torch.float16 saved a layer's values above 65504 as inf, silently. Now the batch
    holding them is refused (naming the layer and dtype=torch.float32), no manifest is written,
    the batches before it are kept; a value that was already inf in the forward is saved as is."""
    torch.manual_seed(0)
    model = _Loud()
    x = torch.randn(6, 4)
    x[4:] *= 1e5
    with torch.no_grad():
        y = model.lin(x)
    assert y[:4].abs().max() < 100 and y[4:].abs().max() > 65504
    with pytest.raises(
        hs.ExtractError, match=r"layer 'lin' has finite values beyond float16.*dtype=torch\.float32"
    ):
        hs.extract(model, TensorDataset(x), ["lin"], tmp_path / "h", batch_size=2,
                   dtype=torch.float16, progress=False)  # fmt: skip
    assert not (tmp_path / "h" / "manifest.json").exists()
    state = tmp_path / "h" / ".hookscope-extract"
    assert json.loads((state / "journal-0.json").read_text())["done"] == 2  # batches 0 and 1 kept
    ok = hs.extract(model, TensorDataset(x[:4]), ["lin", "inf"], tmp_path / "ok", batch_size=2,
                    dtype=torch.float16, progress=False)  # fmt: skip
    np.testing.assert_array_equal(ok["lin"], y[:4].numpy().astype(np.float16))
    np.testing.assert_array_equal(ok["inf"], (y[:4] * 1e38 * 1e38).numpy().astype(np.float16))
    assert np.isinf(ok["inf"]).any()


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


_HEAD = nn.Linear(4, 3)


def _scaled(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _bump_head(model: nn.Module) -> None:
    with torch.no_grad():
        _HEAD.weight.add_(1.0)


def _rescale(model: nn.Module) -> None:
    global _scaled

    def _scaled(t: torch.Tensor) -> torch.Tensor:  # a new helper under the same name
        return t * 3


def _zero_mask(model: nn.Module) -> None:
    model.mask.zero_()


_CASES = {
    # what changed between the run and its resume, the model, the layer, the pool, what is named
    "LeakyReLU slope": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.1)),
        lambda m: setattr(m[1], "negative_slope", 0.5),
        "1",
        None,
        "model attributes",
    ),
    "BatchNorm eps": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        lambda m: setattr(m[1], "eps", 10.0),
        "1",
        None,
        "model attributes",
    ),
    "Softmax dim": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.Unflatten(1, (2, 2)), nn.Softmax(dim=1)),
        lambda m: setattr(m[2], "dim", 2),
        "2",
        None,
        "model attributes",
    ),
    "non-persistent buffer": (_Masked, _zero_mask, "", None, "model weights"),
    "global module in pool": (
        lambda: nn.Sequential(nn.Linear(4, 4)),
        _bump_head,
        "0",
        lambda t: _HEAD(t),
        "pool function",
    ),
    "global function in pool": (
        lambda: nn.Sequential(nn.Linear(4, 4)),
        _rescale,
        "0",
        lambda t: _scaled(t),
        "pool function",
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_a_resume_after_a_change_the_fingerprint_missed_is_refused(tmp_path, case):
    """A run interrupted after 2 batches, then resumed after a change that changes the features
    (a PyTorch module's setting, a non-persistent buffer, a module or function the pool function
    reads as a global): the resume went on silently, the file mixing the rows of two models.
    Now it is refused, naming what changed; an unchanged resume equals a plain forward."""
    make, change, layer, pool, named = _CASES[case]
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    model = make()
    with pytest.raises(KeyboardInterrupt):
        hs.extract(model, _Interrupting(TensorDataset(x), 4), [layer], tmp_path / "a",
                   batch_size=2, pool=pool, progress=False)  # fmt: skip
    change(model)
    with pytest.raises(hs.ExtractError, match=f"unfinished extraction of another run.*{named}"):
        hs.extract(model, TensorDataset(x), [layer], tmp_path / "a", batch_size=2, pool=pool,
                   progress=False)  # fmt: skip
    # the same sequence without a change resumes, to the values of a plain forward
    torch.manual_seed(0)
    model = make().eval()
    with pytest.raises(KeyboardInterrupt):
        hs.extract(model, _Interrupting(TensorDataset(x), 4), [layer], tmp_path / "b",
                   batch_size=2, pool=pool, progress=False)  # fmt: skip
    feats = hs.extract(model, TensorDataset(x), [layer], tmp_path / "b", batch_size=2, pool=pool,
                       progress=False)  # fmt: skip
    with torch.no_grad():
        want = model.get_submodule(layer)
        out = {}
        h = want.register_forward_hook(lambda m, i, o: out.setdefault("o", o))
        model(x)
        h.remove()
        ref = out["o"] if pool is None else pool(out["o"])
    np.testing.assert_allclose(feats[layer], ref.numpy(), rtol=1e-6, atol=1e-6)


def test_load_features_refuses_a_file_cut_short_or_replaced(tmp_path):
    """A feature file cut short (a copy that stopped) raised numpy's bare ValueError; one replaced
    by an array of another shape or dtype (5 rows for 6 samples) was returned as is, its rows
    no longer those of index.npy. Both are refused with an ExtractError naming the file; an
    intact folder loads the values of a plain forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(6, 4)
    hs.extract(model, TensorDataset(x), ["0", "1"], tmp_path, batch_size=4, progress=False)
    with torch.no_grad():  # batch by batch, as extracted
        want = torch.cat([model[0](x[:4]), model[0](x[4:])]).numpy()
    np.testing.assert_array_equal(hs.load_features(tmp_path)["0"], want)
    path = tmp_path / "0.npy"
    good = path.read_bytes()
    path.write_bytes(good[:-20])
    with pytest.raises(hs.ExtractError, match=r"0\.npy cannot be read.*cut short"):
        hs.load_features(tmp_path)["0"]
    for bad in (np.zeros((5, 4), np.float32), np.zeros((6, 4), np.float16)):
        np.save(path, bad)
        with pytest.raises(
            hs.ExtractError, match=r"0\.npy holds an array of shape .* says \(6, 4\)"
        ):
            hs.load_features(tmp_path)["0"]
    np.save(tmp_path / "index.npy", np.arange(5))
    with pytest.raises(hs.ExtractError, match=r"index\.npy holds an array of shape \(5,\)"):
        hs.load_features(tmp_path)


def test_a_folder_of_an_earlier_fingerprint_scheme_is_named_as_such(tmp_path):
    """The fingerprint now covers more (PyTorch modules' settings, non-persistent buffers): a
    finished folder an earlier hookscope wrote (its fields without ``scheme``, another hash) is
    refused as before, but named as another version's, not as a run whose model weights and
    attributes changed (which the user did not change)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.1))
    data = TensorDataset(torch.randn(6, 4))
    hs.extract(model, data, ["1"], tmp_path, batch_size=3)
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    fields = manifest["fingerprint_fields"]
    del fields["scheme"]
    fields["weights"] = fields["attributes"] = "an earlier hash"
    manifest["fingerprint"] = "0" * 24
    path.write_text(json.dumps(manifest))
    with pytest.raises(hs.ExtractError, match=r"another hookscope version") as got:
        hs.extract(model, data, ["1"], tmp_path, batch_size=3)
    assert "weights" not in str(got.value)
