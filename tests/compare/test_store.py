"""The record format of hs.record (``values.bin``: each dense tensor's bytes, then a pickle of the
value that refers to them): values come back exactly (dtype, shape, every element), whatever
their kind and nesting; a file cut short or an index that points elsewhere is refused naming the
record, never read as other bytes; two records never write into one folder.

Stated expectations of what comes back: a dense tensor comes back **contiguous** (a
non-contiguous view is written as its contiguous copy), as a plain ``torch.Tensor`` that does not
require grad and shares storage with nothing (views of one storage come back as separate
tensors; the identity of a tensor passed twice is restored by the call's alias list, not by the
store). A tensor of another kind (sparse, quantized, a subclass such as ``nn.Parameter``, a lazy
conjugate) is pickled whole and comes back of that kind."""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import pickle
import shutil
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from hookscope.compare._store import SPOOL, Spool, SpoolReader

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    aux: torch.Tensor | None = None
    step: int = 0


def _roundtrip(tmp_path: Path, values: dict[str, Any]) -> dict[str, Any]:
    spool = Spool(tmp_path)
    for k, v in values.items():
        spool.write(k, v)
    spool.close()
    reader = SpoolReader(spool.path, json.loads(json.dumps(spool.index)))  # as index.json has it
    reader.check()
    return {k: reader.get(k) for k in reversed(list(values))}  # any order


def _same(got: Any, want: Any) -> None:
    """Exactly equal: types, structure, dtypes, shapes, every element."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and got.layout == want.layout
        if want.is_sparse:
            got, want = got.coalesce(), want.coalesce()
            assert torch.equal(got.indices(), want.indices())
            assert torch.equal(got.values(), want.values())
        elif want.is_quantized:
            assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
            assert torch.equal(got.int_repr(), want.int_repr())
        else:
            assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())
        return
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for x, y in zip(got, want):
            _same(x, y)
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            _same(getattr(got, f.name), getattr(want, f.name))
    else:
        assert got == want


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape).stride()


_gen = torch.Generator().manual_seed(0)
_DTYPES = {
    "float32": torch.randn(3, 5, generator=_gen),
    "float16": torch.randn(3, 5, generator=_gen).half(),
    "bfloat16": torch.randn(3, 5, generator=_gen).bfloat16(),
    "float64": torch.randn(3, 5, generator=_gen).double(),
    "int64": torch.randint(-(2**40), 2**40, (7,), generator=_gen),
    "int8": torch.randint(-128, 128, (2, 3), generator=_gen, dtype=torch.int8),
    "uint8": torch.randint(0, 256, (4,), generator=_gen, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.randn(2, 3, generator=_gen, dtype=torch.complex64),
    "float8_e4m3fn": torch.randn(6, generator=_gen).to(torch.float8_e4m3fn),
    "nan_inf_negzero": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
}


@pytest.mark.parametrize("name", list(_DTYPES))
def test_every_dtype_comes_back_bit_for_bit(tmp_path, name):
    t = _DTYPES[name]
    got = _roundtrip(tmp_path, {"v": t})["v"]
    assert got.__class__ is torch.Tensor and got.dtype == t.dtype and got.shape == t.shape
    # bit for bit (NaN payloads and -0.0 included): compare the raw bytes
    assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert got.is_contiguous() and not got.requires_grad


@pytest.mark.parametrize(
    "t",
    [torch.tensor(2.5), torch.tensor(7, dtype=torch.int64), torch.empty(0), torch.empty(2, 0, 3)],
    ids=["0-dim float", "0-dim int", "empty", "empty 2x0x3"],
)
def test_zero_dim_and_empty_tensors_keep_their_shape(tmp_path, t):
    got = _roundtrip(tmp_path, {"v": (t, t.clone())})["v"]
    for g in got:
        assert g.shape == t.shape and g.dtype == t.dtype and torch.equal(g, t)
        assert g.stride() == _contiguous_strides(t.shape)


@pytest.mark.parametrize(
    "view",
    [
        lambda b: b.t(),
        lambda b: b[:, 1::2],
        lambda b: b[1],
        lambda b: b[:, :1].expand(4, 6),  # stride 0
        lambda b: b.unsqueeze(0).permute(2, 0, 1),
        lambda b: b.as_strided((2, 2), (7, 2), 3),
    ],
    ids=["transposed", "sliced with a step", "a row", "expanded", "permuted", "as_strided"],
)
def test_a_non_contiguous_view_comes_back_contiguous_with_its_values(tmp_path, view):
    base = torch.arange(24.0).reshape(4, 6)
    v = view(base)
    got = _roundtrip(tmp_path, {"v": v})["v"]
    assert torch.equal(got, v) and got.shape == v.shape
    assert got.is_contiguous() and got.stride() == _contiguous_strides(v.shape)
    assert got.storage_offset() == 0 and got.untyped_storage().nbytes() == v.numel() * 4


def test_tensors_sharing_storage_come_back_as_separate_tensors(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    t = torch.randn(3)
    value = (base, base[1], base.t(), t, t)  # views of one storage; one tensor twice
    got = _roundtrip(tmp_path, {"v": value})["v"]
    _same(got, value)
    ptrs = {g.untyped_storage().data_ptr() for g in got}
    assert len(ptrs) == 5  # no storage shared, the repeated tensor included
    got[0].zero_()
    assert torch.equal(got[1], base[1]) and torch.equal(got[2], base.t())


def test_nested_values_come_back_with_their_types_and_none_leaves(tmp_path):
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    value = (
        {"a": x, "b": [x + 1, None, (x * 2, "text", 3)], "c": None},
        Pair(x.t(), Pair(None, x.half())),
        Out(logits=x, hidden=(x, x - 1), aux=None, step=7),
        [],
        (),
        {},
        None,
        1.5,
    )
    got = _roundtrip(tmp_path, {"v": value, "none": None, "scalar": 3})
    _same(got["v"], value)
    assert got["none"] is None and got["scalar"] == 3


def test_a_transformers_model_output_comes_back_as_that_class(tmp_path):
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    g = torch.Generator().manual_seed(2)
    out = CausalLMOutputWithPast(
        logits=torch.randn(1, 4, 9, generator=g), hidden_states=(torch.randn(1, 4, 8, generator=g),)
    )
    got = _roundtrip(tmp_path, {"v": out})["v"]
    assert type(got) is CausalLMOutputWithPast
    assert list(got.keys()) == ["logits", "hidden_states"]  # None fields stay out of the dict
    assert got.loss is None and got.past_key_values is None
    assert torch.equal(got.logits, out.logits) and torch.equal(got[1][0], out.hidden_states[0])


def test_tensors_requiring_grad_come_back_as_plain_data(tmp_path):
    leaf = torch.randn(3, requires_grad=True)
    value = {"leaf": leaf, "nonleaf": leaf * 2}
    got = _roundtrip(tmp_path, {"v": value})["v"]
    for k, t in value.items():
        assert torch.equal(got[k], t.detach()) and not got[k].requires_grad
        assert got[k].grad_fn is None and got[k].is_leaf


def test_tensors_of_other_kinds_are_pickled_whole_and_keep_their_kind(tmp_path):
    param = nn.Parameter(torch.randn(2, 3))
    dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    dense[dense.abs() < 0.8] = 0
    sparse = dense.to_sparse()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in recent PyTorch
        quant = torch.quantize_per_tensor(torch.randn(5), 0.05, 3, torch.quint8)
    conj = torch.randn(3, dtype=torch.complex64).conj()  # a lazy conjugate (conj bit set)
    neg = torch._neg_view(torch.randn(3))
    value = {"param": param, "sparse": sparse, "quant": quant, "conj": conj, "neg": neg}
    got = _roundtrip(tmp_path, {"v": value})["v"]
    _same(got, value)
    assert type(got["param"]) is nn.Parameter and got["param"].requires_grad
    assert got["sparse"].layout is torch.sparse_coo
    assert torch.equal(got["sparse"].to_dense(), dense)
    assert torch.equal(got["conj"].resolve_conj(), conj.resolve_conj())  # not the unconjugated


def test_each_read_is_a_fresh_copy(tmp_path):
    t = torch.arange(5.0)
    spool = Spool(tmp_path)
    spool.write("v", t)
    spool.close()
    reader = SpoolReader(spool.path, spool.index)
    first = reader.get("v")
    first.add_(100)
    assert torch.equal(reader.get("v"), t)
    assert reader.get("missing", "default") == "default"


def test_values_written_from_several_threads_at_once_all_come_back(tmp_path):
    """Autograd runs gradient hooks in one thread per device: writes must not interleave."""
    spool = Spool(tmp_path)
    want = {
        f"k{i}_{j}": torch.full((257 + i,), float(i * 1000 + j))
        for i in range(8)
        for j in range(40)
    }
    start = threading.Barrier(8)

    def writer(i: int) -> None:
        start.wait()
        for j in range(40):
            spool.write(f"k{i}_{j}", want[f"k{i}_{j}"])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    spool.close()
    reader = SpoolReader(spool.path, spool.index)
    reader.check()
    for k, t in want.items():
        assert torch.equal(reader.get(k), t), k


def test_a_write_after_close_is_refused_not_a_new_file(tmp_path):
    spool = Spool(tmp_path)
    spool.write("a", torch.ones(3))
    spool.close()
    with pytest.raises(hs.CompareError, match="after the record .* was closed"):
        spool.write("grad0_0", torch.ones(3))
    assert torch.equal(SpoolReader(spool.path, spool.index).get("a"), torch.ones(3))


# -- damaged records ---------------------------------------------------------------------------
def _recorded(folder: Path) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with hs.record(net, folder):
        net(x).sum().backward()
    net.zero_grad(set_to_none=True)
    return net, x


def test_a_sound_record_compares_exactly(tmp_path):
    net, x = _recorded(tmp_path)
    r = hs.compare(tmp_path, copy.deepcopy(net), x, loss_fn=lambda o: o.sum())
    assert [row.error for row in r.rows] == [0.0] * 4
    assert [row.grad_error for row in r.rows] == [0.0] * 4


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.97, -1], ids=["emptied", "30%", "97%", "1 byte"])
def test_a_values_bin_cut_short_is_refused_naming_the_record(tmp_path, keep):
    net, x = _recorded(tmp_path)
    path = tmp_path / SPOOL
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1 if keep == -1 else int(size * keep))
    with pytest.raises(hs.CompareError) as info:
        hs.compare(tmp_path, copy.deepcopy(net), x, loss_fn=lambda o: o.sum())
    msg = str(info.value)
    assert str(tmp_path) in msg and "damaged" in msg and "cut short" in msg, msg


def test_an_index_changed_after_the_record_is_refused_naming_the_record(tmp_path):
    """Two values' places swapped in index.json (a hand edit, a merge of two indexes): each
    reads back whole, so compare named a culprit on a fault-free copy; the index's own checksum
    refuses it."""
    net, x = _recorded(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    index["values"]["out1"], index["values"]["out2"] = (
        index["values"]["out2"],
        index["values"]["out1"],
    )
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="index.json was changed after the record") as info:
        hs.compare(tmp_path, copy.deepcopy(net), x)
    assert str(tmp_path) in str(info.value)


def test_an_index_pointing_past_the_end_is_refused_naming_the_record(tmp_path):
    net, x = _recorded(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    del index["checksums"]["index.json"]  # (an index without its own checksum: the reader's checks)
    size = (tmp_path / SPOOL).stat().st_size
    _, n = index["values"]["out1"]
    index["values"]["out1"] = [size - 2, n]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="damaged") as info:
        hs.compare(tmp_path, copy.deepcopy(net), x)
    assert str(tmp_path) in str(info.value) and "the output of module call 1" in str(info.value)
    index["values"]["out1"] = "nonsense"
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="not \\(offset, length\\) pairs"):
        hs.compare(tmp_path, copy.deepcopy(net), x)


def test_bytes_that_are_not_the_value_are_refused_not_unpickled_raw(tmp_path):
    net, x = _recorded(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    at, n = index["values"]["out3"]
    with open(tmp_path / SPOOL, "r+b") as f:  # overwrite the pickle of the model's output
        f.seek(at)
        f.write(b"\x00" * n)
    with pytest.raises(hs.CompareError, match="damaged: values.bin is not the file written"):
        hs.compare(tmp_path, copy.deepcopy(net), x)  # the checksum the record keeps
    # a record without checksums (made before they were kept): the reader's own checks
    del index["checksums"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="damaged.*cannot be read back") as info:
        hs.compare(tmp_path, copy.deepcopy(net), x)
    assert str(tmp_path) in str(info.value)
    # an index pointing into another value's tensor bytes: no pickle there either
    index["values"]["out3"] = [0, 40]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match="damaged"):
        hs.compare(tmp_path, copy.deepcopy(net), x)


def test_a_tensor_reference_past_the_end_is_refused_not_read_as_uninitialised_memory(tmp_path):
    """A pickle whose tensor lies beyond the end of the file (the old reader returned
    ``torch.empty(shape)``, whatever memory held, when it read no bytes)."""
    buf = __import__("io").BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: (
        (10_000, "float32", (4,)) if isinstance(obj, torch.Tensor) else None
    )  # type: ignore[method-assign]
    pickler.dump((torch.zeros(4),))
    (tmp_path / SPOOL).write_bytes(buf.getvalue())
    reader = SpoolReader(tmp_path / SPOOL, {"out0": (0, len(buf.getvalue()))})
    reader.check()  # the pickle itself lies inside the file
    with pytest.raises(
        hs.CompareError, match="a tensor of the output of module call 0 .*cut short"
    ):
        reader.get("out0")


def test_a_missing_values_bin_or_params_pt_is_refused_naming_the_record(tmp_path):
    net, x = _recorded(tmp_path / "a")
    (tmp_path / "a" / SPOOL).unlink()
    with pytest.raises(hs.CompareError, match=f"damaged: {SPOOL} is missing"):
        hs.compare(tmp_path / "a", copy.deepcopy(net), x)
    _recorded(tmp_path / "b")
    (tmp_path / "b" / "params.pt").write_bytes(b"cut")
    with pytest.raises(hs.CompareError, match="damaged: params.pt is not the file written"):
        hs.compare(tmp_path / "b", copy.deepcopy(net), x)


def test_a_value_of_a_class_not_importable_here_is_refused_naming_why(tmp_path):
    mod = types.ModuleType("hookscope_test_gone")

    @dataclasses.dataclass
    class Gone:
        t: torch.Tensor

    Gone.__module__, Gone.__qualname__ = mod.__name__, "Gone"
    mod.Gone = Gone  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        spool = Spool(tmp_path)
        spool.write("out2", Gone(torch.ones(2)))
        spool.close()
    finally:
        del sys.modules[mod.__name__]
    with pytest.raises(hs.CompareError, match="output of module call 2.*must be importable"):
        SpoolReader(spool.path, spool.index).get("out2")


def test_an_output_that_cannot_be_pickled_is_refused_while_recording(tmp_path):
    Local = collections.namedtuple("Local", "y")  # a class defined inside a function

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> Any:
            return Local(self.fc(x))

    net = Net()
    with pytest.raises(hs.CompareError) as info, hs.record(net, tmp_path):
        net(torch.randn(2, 3))
    msg = str(info.value)
    assert "cannot write the output of module call 0 (Local)" in msg and "module level" in msg
    assert not (tmp_path / SPOOL).exists() and not (tmp_path / "index.json").exists()


# -- a record's folder -------------------------------------------------------------------------
def test_a_record_whose_block_raised_leaves_nothing_and_the_folder_is_usable(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(RuntimeError, match="boom"), hs.record(net, tmp_path):
        net(torch.randn(2, 4))
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    net.zero_grad(set_to_none=True)
    x = torch.randn(2, 4)
    with hs.record(net, tmp_path):
        net(x)
    assert hs.compare(tmp_path, copy.deepcopy(net), x).row("0").error == 0.0


def test_a_second_record_into_a_folder_being_written_is_refused_and_the_first_is_intact(tmp_path):
    """Two records into one folder (two processes, or nested blocks): the one that comes second
    is refused when it starts (the old format truncated the first one's file and both wrote at
    their own offsets: values silently mixed)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    other = copy.deepcopy(net)
    x = torch.randn(3, 4)
    with hs.record(net, tmp_path):
        out = net(x)  # the first record has written its forward
        refused = pytest.raises(hs.CompareError, match=f"already holds a {SPOOL}: another")
        with refused, hs.record(other, tmp_path):
            other(x * 10).sum().backward()
        out.sum().backward()
    net.zero_grad(set_to_none=True)
    r = hs.compare(tmp_path, copy.deepcopy(net), x, loss_fn=lambda o: o.sum())
    assert [row.error for row in r.rows] == [0.0] * 4
    assert [row.grad_error for row in r.rows] == [0.0] * 4


def test_a_values_bin_left_by_a_killed_run_is_refused_naming_the_fix(tmp_path):
    (tmp_path / SPOOL).write_bytes(b"half a run")
    net = nn.Linear(2, 2)
    refused = pytest.raises(hs.CompareError, match=f"delete {SPOOL} if no record is running")
    with refused, hs.record(net, tmp_path):
        net(torch.randn(1, 2))
    assert (tmp_path / SPOOL).read_bytes() == b"half a run"  # left as found


class _HandsOn(nn.Module):
    """Outputs handed to the next call (written once), one changed in place before it is handed
    on (written again: other bytes), one input to three modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h2 = self.b(h)
        h2.mul_(3.0)  # changed after b returned it
        return self.c(h2) + self.d(h2)


def test_a_value_written_again_unchanged_is_stored_once_and_reads_back_as_plain_hooks_saw():
    import importlib

    rec_mod = importlib.import_module("hookscope.compare._record")
    torch.manual_seed(0)
    m = _HandsOn()
    x = torch.randn(4, 8)
    seen: dict[tuple[str, str], torch.Tensor] = {}
    hooks = []
    for name, mod in m.named_modules():
        hooks.append(
            mod.register_forward_pre_hook(
                lambda _m, a, name=name: seen.__setitem__((name, "in"), a[0].detach().clone())
            )
        )
        hooks.append(mod.register_forward_hook(
            lambda _m, a, o, name=name: seen.__setitem__((name, "out"), o.detach().clone())))  # fmt: skip
    m(x).sum().backward()
    for h in hooks:
        h.remove()
    m.zero_grad(set_to_none=True)
    import tempfile

    folder = Path(tempfile.mkdtemp())
    with hs.record(m, folder / "r"):
        m(x).sum().backward()
    rec = rec_mod.load_record(folder / "r", "mean")
    for c in rec.calls:
        assert torch.equal(c.inputs[0][0], seen[(c.name, "in")]), c.name
        assert torch.equal(c.output, seen[(c.name, "out")]), c.name
    # 5 calls' inputs and outputs are 10 values of 4x8 floats; distinct: x, a's output, b's
    # output before and after the in-place change, c's and d's outputs, the root's output (7)
    index = json.loads((folder / "r" / "index.json").read_text())
    import re

    values = [k for k in index["values"] if re.fullmatch(r"(in|out)\d+", k)]
    grads = [k for k in index["values"] if "grad" in k]
    assert len(values) == 10
    pickles = sum(n for k, (_, n) in index["values"].items())
    tensor_bytes = (folder / "r" / SPOOL).stat().st_size - pickles
    assert tensor_bytes == (7 + len(grads)) * 4 * 8 * 4  # each distinct tensor once


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda j: j.__setitem__("calls", j["calls"][1:]), "whose parent is not a call before it"),
        (lambda j: j.__setitem__("calls", j["calls"][:-1]), "listing children it does not hold"),
        (lambda j: j.pop("values"), 'has no "values"'),
        (lambda j: j["values"].pop("out1"), "has no the output of module call 1|has no .*call 1"),
        (lambda j: j.pop("dtype"), 'has "dtype" None'),
        (lambda j: j.__setitem__("dtype", "float33"), "has \"dtype\" 'float33'"),
        (lambda j: j.pop("grads"), 'has no "grads"'),
        (lambda j: j.__setitem__("version", "2"), "has \"version\" '2'"),
    ],
    ids=[
        "first-call",
        "last-call",
        "values",
        "one-value",
        "dtype",
        "bad-dtype",
        "grads",
        "version",
    ],
)
def test_a_damaged_index_is_refused_by_name_never_a_hang_or_a_traceback(tmp_path, edit, why):
    """An index.json edited by hand or cut by a merge: a call list without its first entry made
    hs.compare loop forever (a call its own ancestor), others were accepted (every error inf,
    a call read as run in one run only) or raised KeyError/AttributeError."""
    net, x = _recorded(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    edit(index)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(hs.CompareError, match=rf"is damaged: its index.json .*({why})"):
        hs.compare(tmp_path, copy.deepcopy(net), x)


def test_a_file_changed_after_the_record_or_of_another_record_is_refused(tmp_path):
    """One byte of values.bin changed, or the values.bin (or params.pt) of another record of
    the same model and size put beside this index.json: read as other values (an exact copy
    named a culprit); the checksums the index keeps refuse each, naming the file."""
    net, x = _recorded(tmp_path / "a")
    with hs.record(net, tmp_path / "b"):  # the same model on other inputs
        net(x + 1).sum().backward()
    net.zero_grad(set_to_none=True)
    assert (tmp_path / "a" / SPOOL).stat().st_size == (tmp_path / "b" / SPOOL).stat().st_size
    for name in (SPOOL, "params.pt"):
        case = tmp_path / f"mixed-{name}"
        shutil.copytree(tmp_path / "a", case)
        shutil.copy(tmp_path / "b" / name, case / name)
        with pytest.raises(hs.CompareError, match=rf"damaged: {name} is not the file written"):
            hs.compare(case, copy.deepcopy(net), x)
    data = bytearray((tmp_path / "a" / SPOOL).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "a" / SPOOL).write_bytes(bytes(data))
    with pytest.raises(hs.CompareError, match=rf"damaged: {SPOOL} is not the file written"):
        hs.compare(tmp_path / "a", copy.deepcopy(net), x)
