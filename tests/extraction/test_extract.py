"""``extract`` / ``load_features`` in process: values against a direct forward, pooling, bad data,
interruption and resume, write errors, the on-disk format (numpy alone)."""

from __future__ import annotations

import errno
import json
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import hookscope as hs
from helpers.common import files_of
from hookscope.extraction import _featstore


class TokenNet(nn.Module):
    """conv -> ReLU(inplace) -> tokens (B, T, D) -> linear head; exercises every pool mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.proj = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.conv(x))  # modifies conv's output in place
        tokens = self.proj(h.flatten(2).transpose(1, 2))  # (B, H*W, 5)
        return self.head(tokens.mean(1))


def reference(net: TokenNet, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each layer's output computed by hand, without hooks."""
    with torch.no_grad():
        conv = net.conv(x)
        relu = torch.relu(conv)
        proj = net.proj(relu.flatten(2).transpose(1, 2))
        head = net.head(proj.mean(1))
    return {"conv": conv, "relu": relu, "proj": proj, "head": head}


POOLS = {
    None: lambda t: t,
    "avg": lambda t: t.mean((2, 3)) if t.dim() == 4 else (t.mean(1) if t.dim() == 3 else t),
    "max": lambda t: t.amax((2, 3)) if t.dim() == 4 else (t.amax(1) if t.dim() == 3 else t),
    "flatten": lambda t: t.reshape(len(t), -1),
}


@pytest.fixture
def net() -> TokenNet:
    torch.manual_seed(0)
    return TokenNet()


@pytest.fixture
def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(11, 3, 6, 6, generator=g), torch.arange(11))


@pytest.mark.parametrize("pool", [None, "avg", "max", "flatten"])
def test_features_equal_a_direct_forward(net, data, tmp_path, pool):
    feats = hs.extract(
        net,
        data,
        ["conv", "relu", "proj", "head"],
        tmp_path,
        batch_size=4,
        pool=pool,
        progress=False,
    )
    ref = reference(net, data.tensors[0])
    for name in ["conv", "relu", "proj", "head"]:
        want = POOLS[pool](ref[name]).numpy()
        assert feats[name].shape == want.shape
        np.testing.assert_allclose(feats[name], want, rtol=1e-5, atol=1e-6)
    assert feats.index.tolist() == list(range(11))
    assert feats.count == 11 and feats.valid.all() and feats.skipped == []


def test_cls_and_callable_pool(net, data, tmp_path):
    ref = reference(net, data.tensors[0])
    cls = hs.extract(net, data, "proj", tmp_path / "cls", batch_size=4, pool="cls", progress=False)
    np.testing.assert_allclose(cls["proj"], ref["proj"][:, 0].numpy(), rtol=1e-5, atol=1e-6)

    def norms(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(1).norm(dim=1, keepdim=True)

    custom = hs.extract(
        net, data, ["conv", "head"], tmp_path / "fn", batch_size=4, pool=norms, progress=False
    )
    np.testing.assert_allclose(custom["conv"], norms(ref["conv"]).numpy(), rtol=1e-5)
    np.testing.assert_allclose(custom["head"], norms(ref["head"]).numpy(), rtol=1e-5)
    assert custom.manifest["pool"].endswith("norms")
    with pytest.raises(hs.ExtractError, match="first token"):
        hs.extract(net, data, "head", tmp_path / "bad", pool="cls", progress=False)


def test_torchvision_resnet_matches_reference_and_stops_early(tmp_path):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=7).eval()
    x = torch.randn(6, 3, 32, 32)
    calls = []
    handle = model.fc.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        feats = hs.extract(
            model,
            TensorDataset(x),
            ["layer2", "avgpool"],
            tmp_path,
            batch_size=4,
            pool="avg",
            progress=False,
        )
    finally:
        handle.remove()
    assert calls == []  # the forward pass stopped at avgpool: fc never ran
    with torch.no_grad():
        h = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        l2 = model.layer2(model.layer1(h))
        pooled = model.avgpool(model.layer4(model.layer3(l2)))
    np.testing.assert_allclose(feats["layer2"], l2.mean((2, 3)).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(feats["avgpool"], pooled.flatten(1).numpy(), rtol=1e-4, atol=1e-5)


def test_model_left_as_found_and_dataloader_settings_used(net, data, tmp_path):
    net.train()
    net.relu.eval()
    loader = DataLoader(
        data, batch_size=3, collate_fn=lambda items: torch.stack([x for x, _ in items])
    )
    feats = hs.extract(net, loader, "head", tmp_path, progress=False)
    assert net.training and not net.relu.training and net.conv.training
    assert feats.manifest["batch_size"] == 3
    np.testing.assert_allclose(
        feats["head"], reference(net, data.tensors[0])["head"].numpy(), rtol=1e-5, atol=1e-6
    )
    # a shuffling sampler is honoured: every sample, each row at its dataset index
    shuffled = hs.extract(
        net, DataLoader(data, batch_size=3, shuffle=True), "head", tmp_path / "s", progress=False
    )
    np.testing.assert_allclose(shuffled["head"], feats["head"], rtol=1e-6, atol=1e-7)


def test_readable_with_numpy_alone_and_dtype(net, data, tmp_path):
    hs.extract(
        net,
        data,
        ["conv", "head"],
        tmp_path,
        batch_size=5,
        pool="avg",
        dtype=torch.float16,
        progress=False,
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (
        manifest["layers"] == ["conv", "head"]
        and manifest["count"] == 11
        and manifest["dtype"] == "float16"
    )
    assert manifest["shapes"] == {"conv": [11, 6], "head": [11, 3]}
    assert set(manifest["versions"]) >= {"hookscope", "torch", "numpy"}
    conv = np.load(tmp_path / manifest["files"]["conv"], mmap_mode="r")
    assert isinstance(conv, np.memmap) and conv.dtype == np.float16
    # the saved value is the layer's fp32 row rounded to fp16: exact against the same batches
    # (5, 5, 1) rounded by hand, and within half an fp16 step of one batch of 11 (whose fp32
    # sums may round differently)
    x = data.tensors[0]
    exact = torch.cat([reference(net, x[i : i + 5])["conv"].mean((2, 3)) for i in (0, 5, 10)])
    np.testing.assert_array_equal(conv, exact.half().numpy())
    whole = reference(net, x)["conv"].mean((2, 3)).numpy()
    step = np.spacing(np.abs(conv)).astype(np.float32)
    assert (np.abs(conv.astype(np.float32) - whole) <= step / 2 + 1e-6).all()
    assert np.load(tmp_path / "index.npy").tolist() == list(range(11))
    assert not (tmp_path / _featstore.STATE_DIR).exists()
    with pytest.raises(hs.ExtractError, match="bfloat16"):
        hs.extract(net, data, "conv", tmp_path / "bf", dtype=torch.bfloat16, progress=False)


class Interrupting(Dataset):
    """Wraps a dataset; raises KeyboardInterrupt at one index (like Ctrl-C mid-run)."""

    def __init__(self, base: Dataset, at: int | None) -> None:
        self.base, self.at = base, at

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i == self.at:
            raise KeyboardInterrupt
        return self.base[i]


def test_interrupted_run_resumes_to_identical_files(net, data, tmp_path):
    full = tmp_path / "full"
    hs.extract(net, data, ["conv", "proj"], full, batch_size=2, pool="avg", progress=False)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        hs.extract(
            net,
            Interrupting(data, 7),
            ["conv", "proj"],
            part,
            batch_size=2,
            pool="avg",
            progress=False,
        )
    assert not (part / "manifest.json").exists()
    with pytest.raises(hs.IncompleteExtractionError, match=r"6 of 11 samples on disk"):
        hs.load_features(part)
    journal = json.loads((part / _featstore.STATE_DIR / "journal-0.json").read_text())
    assert journal["done"] == 3
    hs.extract(
        net,
        Interrupting(data, None),
        ["conv", "proj"],
        part,
        batch_size=2,
        pool="avg",
        progress=False,
    )
    assert files_of(part) == files_of(full)
    # finished + resume: returned as is; another run in the same directory is refused
    again = hs.extract(net, data, ["conv", "proj"], part, batch_size=2, pool="avg", progress=False)
    assert again.count == 11
    with pytest.raises(hs.ExtractError, match="finished extraction of another run"):
        hs.extract(net, data, ["head"], part, batch_size=2, progress=False)
    redo = hs.extract(net, data, ["head"], part, batch_size=2, progress=False, resume=False)
    assert redo.layers == ["head"]


class Paced(Dataset):
    """Yields like ``base``, a little slowly, so the writer drains (and syncs) after each batch."""

    def __init__(self, base: Dataset, delay: float = 0.02) -> None:
        self.base, self.delay = base, delay

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return self.base[i]


def test_write_error_is_clear_and_work_is_kept(net, data, tmp_path, monkeypatch):
    full = hs.extract(net, data, "conv", tmp_path / "full", batch_size=2, progress=False)
    real_write = _featstore.atomic_write_json
    durable = []

    def failing_write(path, obj):
        # the journal's update fails once 3 batches are written (by batch count, not by number
        # of syncs, which depends on how fast the writer drains its queue)
        if path.name.startswith("journal-"):
            if obj["done"] >= 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            durable.append(obj["done"])
        real_write(path, obj)

    monkeypatch.setattr(_featstore, "atomic_write_json", failing_write)
    out = tmp_path / "out"
    with pytest.raises(
        hs.ExtractError, match=r"no space left on device.*kept.*run the same extraction again"
    ) as err:
        hs.extract(net, Paced(data), "conv", out, batch_size=2, progress=False)
    assert durable and durable[-1] < 3  # some work was made durable before the failure
    # the count in the message is what the journal holds durable, not what reached the mapping
    journal = json.loads((out / _featstore.STATE_DIR / "journal-0.json").read_text())
    assert journal["done"] == durable[-1]
    assert f"the {2 * durable[-1]} of 11 samples durably written" in str(err.value)
    monkeypatch.setattr(_featstore, "atomic_write_json", real_write)
    resumed = hs.extract(net, data, "conv", out, batch_size=2, progress=False)
    assert files_of(out) == files_of(full.path)
    np.testing.assert_array_equal(resumed["conv"], full["conv"])


class Flaky(Dataset):
    """Samples 3 and 8 cannot be loaded."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i in (3, 8):
            raise ValueError(f"sample {i} is corrupt")
        return self.base[i]


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_samples_raise_or_skip(net, data, tmp_path, workers):
    with pytest.raises(
        hs.ExtractError, match=r"sample 3 could not be loaded: ValueError: sample 3 is corrupt"
    ):
        hs.extract(
            net,
            Flaky(data),
            "head",
            tmp_path / "r",
            batch_size=4,
            num_workers=workers,
            progress=False,
        )
    with pytest.warns(hs.HookscopeWarning, match=r"2 of 11 samples were skipped.*sample 3"):
        feats = hs.extract(
            net,
            Flaky(data),
            "head",
            tmp_path / "s",
            batch_size=4,
            num_workers=workers,
            on_error="skip",
            progress=False,
        )
    assert [s["row"] for s in feats.skipped] == [3, 8]
    assert feats.skipped[0]["reason"] == "ValueError: sample 3 is corrupt"
    assert feats.manifest["valid"] == 9
    valid = feats.valid
    assert valid.tolist() == [i not in (3, 8) for i in range(11)]
    assert np.isnan(feats["head"][~valid]).all()
    ref = reference(net, data.tensors[0])["head"].numpy()
    np.testing.assert_allclose(feats["head"][valid], ref[valid], rtol=1e-5, atol=1e-6)


def test_bad_arguments(net, data, tmp_path):
    with pytest.raises(hs.LayerNotFoundError, match="conv"):
        hs.extract(net, data, "convv", tmp_path, progress=False)
    with pytest.raises(ValueError, match="pool must be"):
        hs.extract(net, data, "conv", tmp_path, pool="mean", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_error"):
        hs.extract(net, data, "conv", tmp_path, on_error="ignore", progress=False)  # type: ignore[arg-type]
    with pytest.raises(hs.ExtractError, match="not a hookscope feature directory"):
        hs.load_features(tmp_path)


def test_refuses_torchrun_without_process_group(net, data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(hs.ExtractError, match="init_process_group"):
        hs.extract(net, data, "conv", tmp_path, progress=False)


def test_every_row_of_a_skipped_only_batch_and_mixed_dtypes(net, data, tmp_path):
    class Gaps(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int):
            if i in (2, 3):  # a whole batch of 2 fails
                raise OSError("unreadable")
            return data[i][0]

    with pytest.warns(hs.HookscopeWarning, match="2 of 6 samples were skipped"):
        feats = hs.extract(
            net,
            Gaps(),
            ["conv", "head"],
            tmp_path,
            batch_size=2,
            pool="avg",
            on_error="skip",
            progress=False,
        )
    assert feats.valid.tolist() == [True, True, False, False, True, True]
    assert np.isnan(feats["head"][2:4]).all()
    ref = reference(net, data.tensors[0][[0, 1, 4, 5]])["head"].numpy()
    np.testing.assert_allclose(feats["head"][feats.valid], ref, rtol=1e-5, atol=1e-6)


def test_model_error_propagates_and_leaves_the_model_as_found(net, data, tmp_path):
    class Boom(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int):
            x = data[i][0]
            return x if i < 4 else x[:2]  # batch 2 has 2 channels: conv raises inside forward

    net.train()
    with pytest.raises(RuntimeError, match="channels"):
        hs.extract(net, Boom(), "proj", tmp_path, batch_size=2, progress=False)
    assert net.training  # and the autouse fixture checks that no hook was left behind
    journal = json.loads((tmp_path / _featstore.STATE_DIR / "journal-0.json").read_text())
    assert journal["done"] == 2  # the batches before the failure are kept


def test_resume_checks_the_unfinished_run(net, data, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        hs.extract(net, Interrupting(data, 5), "conv", tmp_path, batch_size=2, progress=False)
    with pytest.raises(hs.ExtractError, match="unfinished extraction of another run"):
        hs.extract(net, data, "head", tmp_path, batch_size=2, progress=False)
    feats = hs.extract(net, data, "conv", tmp_path, batch_size=2, progress=False, resume=False)
    np.testing.assert_allclose(
        feats["conv"], reference(net, data.tensors[0])["conv"].numpy(), rtol=1e-5, atol=1e-6
    )
