"""hs.summary against independent references: hand counts, FlopCounterMode, real outputs."""

from __future__ import annotations

import copy
import io
import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import hookscope as hs
from hookscope.cli._modelspec import load_model
from hookscope.summarization._flops import EXTRA_FLOP_FORMULAS
from hookscope.summarization._format import COLUMNS

GOLDEN = Path(__file__).parent / "golden" / "summary"


def reference_flops(model: nn.Module, *args, extra: bool = True, **kwargs) -> FlopCounterMode:
    """FlopCounterMode over the same forward summary runs (no_grad, MHA fast path off)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with (
            torch.no_grad(),
            FlopCounterMode(
                display=False, custom_mapping=EXTRA_FLOP_FORMULAS if extra else None
            ) as fc,
        ):
            model(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return fc


def unique_params(model: nn.Module) -> tuple[int, int]:
    ps = {id(p): p for m in model.modules() for p in m._parameters.values() if p is not None}
    return sum(p.numel() for p in ps.values()), sum(
        p.numel() for p in ps.values() if p.requires_grad
    )


def by_label(s: hs.Summary) -> dict[str, hs.SummaryRow]:
    return {r.label: r for r in s.rows}


def test_mlp_hand_counts(seed):
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 8)
    s = hs.summary(net, x)
    assert [(r.label, r.depth, r.type) for r in s.rows] == [
        ("<root>", 0, "Sequential"),
        ("0", 1, "Linear"),
        ("1", 1, "ReLU"),
        ("2", 1, "Linear"),
    ]
    rows = by_label(s)
    assert (
        rows["0"].params == 8 * 4 + 4
        and rows["2"].params == 4 * 2 + 2
        and rows["<root>"].params == 46
    )
    assert (
        rows["0"].flops == 2 * 3 * 8 * 4
        and rows["2"].flops == 2 * 3 * 4 * 2
        and rows["1"].flops == 0
    )
    assert s.totals.params == s.totals.trainable == 46
    assert (
        s.totals.flops == 2 * 3 * 8 * 4 + 2 * 3 * 4 * 2 == reference_flops(net, x).get_total_flops()
    )
    assert s.totals.param_bytes == 46 * 4
    assert rows["0"].output_shapes == [3, 4] and rows["0"].input_shapes == [3, 8]
    assert rows["0"].output_bytes == 3 * 4 * 4
    assert s.totals.activation_bytes == (3 * 4 + 3 * 4 + 3 * 2) * 4  # leaf outputs
    assert s.totals.peak_memory_bytes >= 3 * 2 * 4
    assert all(r.time_ms >= 0 for r in s.rows) and rows["<root>"].time_ms >= rows["0"].time_ms


def test_tied_embedding_and_output_counted_once():
    lm = load_model(f"{GOLDEN / 'net.py'}:TiedLM")
    ids = torch.tensor([[1, 2, 3, 4]])
    s = hs.summary(lm, ids)
    rows = by_label(s)
    assert s.totals.params == 50 * 16 + (16 * 16 + 16) == unique_params(lm)[0]
    assert rows["embed"].params == 800 and rows["embed"].shared_params == 0
    assert (
        rows["lm_head"].params == 800 and rows["lm_head"].shared_params == 800
    )  # the tied weight repeats
    assert rows["<root>"].params == s.totals.params and rows["<root>"].shared_params == 0
    assert rows["lm_head"].flops == 2 * 4 * 16 * 50
    text = s.to_text(ascii=True)
    assert "800*" in text and "earlier row" in text
    lm.lm_head.weight.requires_grad_(False)  # frozen tied weight: frozen for both users
    assert hs.summary(lm, ids).totals.trainable == 16 * 16 + 16


class Reuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(self.act(self.lin(x))))


def test_reused_modules_row_per_call(seed):
    net = Reuse()
    x = torch.randn(2, 4)
    s = hs.summary(net, x)
    assert [r.label for r in s.rows] == ["<root>", "lin#1", "act#1", "lin#2", "act#2"]
    rows = by_label(s)
    assert rows["lin#1"].calls == 2 and rows["lin#2"].call == 1
    assert rows["lin#1"].shared_params == 0 and rows["lin#2"].shared_params == 20  # counted once
    assert rows["lin#1"].flops == rows["lin#2"].flops == 2 * 2 * 4 * 4
    assert (
        s.totals.params == 20 and s.totals.flops == reference_flops(net, x).get_total_flops() == 128
    )
    assert "#n: the n-th call" in str(s)


def test_resnet50_totals_shapes_and_conv_flops():
    import torchvision

    model = torchvision.models.resnet50()
    x = torch.randn(1, 3, 64, 64)
    s = hs.summary(model, x)
    ref = reference_flops(model, x, extra=False)  # plain FlopCounterMode: no attention here
    assert s.totals.flops == ref.get_total_flops() == sum(r.flops for r in s.rows)
    assert (s.totals.params, s.totals.trainable) == unique_params(model) == (25_557_032, 25_557_032)
    rows = by_label(s)
    assert rows["conv1"].flops == 2 * 64 * 3 * 7 * 7 * 32 * 32
    assert rows["fc"].flops == 2 * 2048 * 1000
    with hs.capture(model, ["layer1.0.conv1", "layer4", "fc"]) as cap, torch.no_grad():
        out = model(x)
    assert rows["<root>"].output_shapes == list(out.shape)
    for name in ["layer1.0.conv1", "layer4", "fc"]:
        assert rows[name].output_shapes == list(cap[name].shape)
        assert rows[name].output_bytes == cap[name].numel() * 4
    # every module ran once, except each Bottleneck's ReLU: 3 calls, 3 rows
    assert len(s.rows) == len(list(model.modules())) + 16 * 2
    assert [r.label for r in s.rows if r.name == "layer2.1.relu"] == [
        "layer2.1.relu#1",
        "layer2.1.relu#2",
        "layer2.1.relu#3",
    ]


def test_vit_b_16_attention_flops_counted():
    import torchvision

    vit = torchvision.models.vit_b_16(image_size=32).eval()  # same architecture, 5 tokens
    x = torch.randn(1, 3, 32, 32)
    s = hs.summary(vit, x)
    tokens, dim = 5, 768
    attn = 4 * tokens * tokens * dim  # QK^T and AV, multiply-add = 2
    proj = (
        2 * tokens * dim * 3 * dim + 2 * tokens * dim * dim
    )  # in_proj + out_proj (run inside MHA)
    rows = by_label(s)
    for i in range(12):
        assert rows[f"encoder.layers.encoder_layer_{i}.self_attention"].flops == attn + proj
    assert (
        s.totals.flops == reference_flops(vit, x).get_total_flops() == sum(r.flops for r in s.rows)
    )
    # plain FlopCounterMode misses the CPU SDPA kernel: exactly the attention part
    assert s.totals.flops - reference_flops(vit, x, extra=False).get_total_flops() == 12 * attn
    assert "encoder.layers.encoder_layer_0.self_attention.out_proj" in s.never_called
    assert torch.backends.mha.get_fastpath_enabled()  # restored


@pytest.mark.slow
def test_vit_b_16_at_224():
    import torchvision

    vit = torchvision.models.vit_b_16().eval()
    x = torch.randn(1, 3, 224, 224)
    s = hs.summary(vit, x)
    assert s.totals.flops == reference_flops(vit, x).get_total_flops()
    attn = 4 * 197 * 197 * 768
    assert s.totals.flops - reference_flops(vit, x, extra=False).get_total_flops() == 12 * attn


@pytest.fixture(scope="module")
def bert():
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def test_bert_keyword_inputs_model_output_and_attention(bert):
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 8, dtype=torch.long)
    s = hs.summary(bert, input_ids=ids, attention_mask=mask)
    rows = by_label(s)
    root = rows["<root>"]
    assert root.input_shapes == {"input_ids": [1, 8], "attention_mask": [1, 8]}
    with torch.no_grad():
        out = bert(input_ids=ids, attention_mask=mask)
    assert root.output_shapes == {k: list(v.shape) for k, v in out.items()}
    assert list(root.output_shapes) == ["last_hidden_state", "pooler_output"]
    for i in range(2):
        assert rows[f"encoder.layer.{i}.attention.self"].flops == 4 * 8 * 8 * 32  # SDPA itself
        assert rows[f"encoder.layer.{i}.attention.self.query"].flops == 2 * 8 * 32 * 32
    assert (
        s.totals.flops
        == reference_flops(bert, input_ids=ids, attention_mask=mask).get_total_flops()
    )
    assert s.totals.flops == sum(r.flops for r in s.rows)
    assert s.totals.params == unique_params(bert)[0]


def test_transformer_encoder_layer_sublayers_shown(seed):
    layer = nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, batch_first=True
    ).eval()
    x = torch.randn(1, 6, 16)
    s = hs.summary(layer, x)
    assert [r.label for r in s.rows] == [
        "<root>",
        "self_attn",
        "dropout1",
        "norm1",
        "linear1",
        "dropout",
        "linear2",
        "dropout2",
        "norm2",
    ]
    rows = by_label(s)
    assert rows["linear1"].flops == 2 * 6 * 16 * 32 and rows["linear2"].flops == 2 * 6 * 32 * 16
    assert rows["self_attn"].flops == 2 * 6 * 16 * 48 + 4 * 6 * 6 * 16 + 2 * 6 * 16 * 16
    assert s.totals.flops == reference_flops(layer, x).get_total_flops()
    assert s.never_called == ["self_attn.out_proj"]


def test_timm_model():
    import timm

    model = timm.create_model("test_vit", pretrained=False).eval()
    x = torch.randn(1, 3, *model.default_cfg["input_size"][1:])
    s = hs.summary(model, x)
    assert (
        s.totals.flops
        == reference_flops(model, x).get_total_flops()
        == sum(r.flops for r in s.rows)
    )
    assert s.totals.params == unique_params(model)[0]
    assert any(r.type == "Attention" and r.flops > 0 for r in s.rows)
    with torch.no_grad():
        assert s.rows[0].output_shapes == list(model(x).shape)


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(2, 5)

    def forward(self, batch: dict, *, scale: torch.Tensor) -> dict:
        h = self.a(batch["x"]) + self.b(batch["y"])
        return {"h": h * scale, "pair": (h, batch["y"])}


def test_dict_inputs_and_nested_outputs(seed):
    net = DictNet()
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}
    s = hs.summary(net, batch, scale=torch.ones(1))
    root = s.rows[0]
    assert root.input_shapes == {"0.x": [4, 3], "0.y": [4, 2], "scale": [1]}
    assert root.output_shapes == {"h": [4, 5], "pair.0": [4, 5], "pair.1": [4, 2]}
    assert root.output_bytes == (20 + 20 + 8) * 4
    assert "0.x:[4, 3], 0.y:[4, 2], scale:[1]" in s.to_text(columns=["input"])
    assert s.totals.flops == 2 * 4 * 3 * 5 + 2 * 4 * 2 * 5


def test_model_left_exactly_as_found(seed):
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Dropout(0.5),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 2),
    )
    net[4].eval()  # mixed modes
    net[0].weight.requires_grad_(False)
    modes = [m.training for m in net.modules()]
    grads = [p.requires_grad for p in net.parameters()]
    buffers = [b.clone() for b in net.buffers()]
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    handle = net.register_forward_hook(lambda m, i, o: None)  # a user hook survives
    try:
        # BatchNorm in train mode updates its statistics, Dropout draws random numbers: both undone
        s = hs.summary(net, x)
        assert list(net._forward_hooks) == [handle.id]
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    assert [m.training for m in net.modules()] == modes and [
        p.requires_grad for p in net.parameters()
    ] == grads
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert s.totals.trainable == s.totals.params - 4 * 3 * 3 * 3
    assert torch.backends.mha.get_fastpath_enabled()


def test_input_size_dtypes_and_errors(seed):
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    rng = torch.get_rng_state()
    s = hs.summary(emb, input_size=(2, 5), dtypes=[torch.long])
    assert torch.equal(rng, torch.get_rng_state())  # seeded local generator
    assert s.rows[0].input_shapes == [2, 5] and s.rows[-1].output_shapes == [2, 5, 3]
    two = hs.summary(DictNetTwo(), input_size=[(1, 3), (1, 2)])
    assert two.rows[0].input_shapes == {"0": [1, 3], "1": [1, 2]}
    with pytest.raises(ValueError, match="not both"):
        hs.summary(emb, torch.zeros(1, 2, dtype=torch.long), input_size=(1, 2))
    with pytest.raises(ValueError, match="did you mean 'flops'"):
        hs.summary(emb, input_size=(1, 2), dtypes=torch.long, columns="flop")
    with pytest.raises(ValueError, match="positive integers"):
        hs.summary(emb, input_size=(1, 0))
    with pytest.raises(ValueError, match="depth"):
        hs.summary(emb, input_size=(1, 2), dtypes=torch.long, depth=-1)
    with pytest.raises(ValueError, match="needs an input"):
        hs.summary(emb)


class DictNetTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def test_depth_collapses_rows_totals_unchanged():
    net = load_model(f"{GOLDEN / 'net.py'}:Net")
    x = torch.randn(1, 3, 8, 8)
    full, top = hs.summary(net, x), hs.summary(net, x, depth=1)
    assert all(r.depth <= 1 for r in top.rows) and len(top.rows) < len(full.rows)
    assert (
        top.totals.flops
        == full.totals.flops
        == sum(r.flops for r in top.rows)
        == sum(r.flops for r in full.rows)
    )
    assert (
        top.totals.params == full.totals.params
        and top.totals.activation_bytes == full.totals.activation_bytes
    )
    block = by_label(top)["block"]
    assert block.flops == 2 * 8 * 8 * 9 * 8 * 8 and block.leaf
    assert [r.label for r in hs.summary(net, x, depth=0).rows] == ["<root>"]


def test_exception_names_the_layer():
    net = load_model(f"{GOLDEN / 'net.py'}:Broken")
    fast = torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(RuntimeError) as info:
        hs.summary(net, torch.randn(1, 3, 8, 8))
    assert info.value.hookscope_layer == "head"
    assert info.value.hookscope_inputs == "(1, 8)"
    assert any("'head' (Linear)" in n for n in info.value.__notes__)
    assert torch.backends.mha.get_fastpath_enabled() == fast


def test_renderings(bert):
    ids = torch.zeros(1, 8, dtype=torch.long)
    s = hs.summary(bert, input_ids=ids, columns="all")
    for text in (str(s), s.to_text(ascii=True), s.to_text(columns=["input", "output"])):
        assert max(len(line) for line in text.splitlines()) <= 100
    assert s.to_text(ascii=True).isascii()
    assert "encoder.layer.0.attention.self.query" in s.to_text(columns=["flops"])
    d = json.loads(s.to_json())
    assert d == s.to_dict() and d["totals"]["flops"] == s.totals.flops
    assert [r["name"] for r in d["rows"]] == [r.name for r in s.rows]
    html = s._repr_html_()
    assert (
        html.count("<tr>") == len(s.rows) + 1
        and "<code>encoder.layer.1.output.dense</code>" in html
    )
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(s)
    out = console.export_text()
    assert "BertSelfAttention" in out and f"{s.totals.params:,}" in out


def test_hf_gpt2_tied_lm_head_counted_once():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(cfg).eval()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    s = hs.summary(gpt, input_ids=ids)
    rows = by_label(s)
    assert s.totals.params == unique_params(gpt)[0] == sum(p.numel() for p in gpt.parameters())
    assert rows["lm_head"].params == rows["lm_head"].shared_params == 64 * 32
    assert rows["lm_head"].flops == 2 * 6 * 32 * 64
    assert (
        s.totals.flops
        == reference_flops(gpt, input_ids=ids).get_total_flops()
        == sum(r.flops for r in s.rows)
    )
    with torch.no_grad():
        logits = gpt(input_ids=ids).logits
    assert rows["<root>"].output_shapes["logits"] == list(logits.shape)


def test_table_fits_with_huge_numbers():
    row = hs.SummaryRow(
        name="model.layers.31.self_attn.q_proj", type="Linear", depth=4, call=0, calls=1,
        input_shapes=[1, 4096, 4096], output_shapes=[1, 4096, 4096],
        params=6_738_415_616, trainable=6_738_415_616, shared_params=0, flops=10**14,
        time_ms=12345.678, output_bytes=2**40, leaf=True,
    )  # fmt: skip
    totals = hs.SummaryTotals(6_738_415_616, 0, 10**14, 2**35, 0, 2**40, 2**40, "CPU", 1.0, "cpu")
    s = hs.Summary("LlamaForCausalLM", "(1, 4096)", [row], totals, columns=tuple(COLUMNS))
    text = s.to_text(ascii=True)
    assert max(map(len, text.splitlines())) <= 100
    assert "6,738,415,616" in text and "100T" in text and "1024.00 GiB" in text


def test_summary_keeps_no_reference_to_the_model():
    import gc
    import weakref

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    s = hs.summary(net, torch.zeros(1, 2))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None and s.totals.params == 6


def test_refuses_scripted_and_compiled_models():
    import warnings

    net = nn.Sequential(nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in recent torch
        scripted = torch.jit.script(net)
    with pytest.raises(hs.UnsupportedModelError, match="TorchScript"):
        hs.summary(scripted, torch.zeros(1, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_and_event_timing():
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    before = torch.cuda.memory_allocated()
    s = hs.summary(net, torch.randn(32, 64, device="cuda"))
    assert s.totals.device.startswith("cuda") and s.totals.peak_memory_bytes >= 32 * 256 * 4
    assert all(r.time_ms > 0 for r in s.rows) and by_label(s)["0"].flops == 2 * 32 * 64 * 256
    assert (
        all(p.is_cuda for p in net.parameters())
        and torch.cuda.memory_allocated() <= before + 32 * 64 * 4
    )


@settings(max_examples=12, deadline=None)
@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=5),
    batch=st.integers(1, 3),
    reuse=st.booleans(),
)
def test_random_mlps_match_hand_counts_and_flopcountermode(widths, batch, reuse):
    layers: list[nn.Module] = []
    for a, b in pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    net = nn.Sequential(*layers)
    x = torch.ones(batch, widths[0])
    s = hs.summary(net, x) if not reuse else hs.summary(nn.Sequential(net, net[-1]), x)
    mm = sum(2 * batch * a * b for a, b in pairwise(widths))
    assert (
        s.totals.flops
        == mm
        == sum(r.flops for r in s.rows)
        == reference_flops(net, x).get_total_flops()
    )
    assert s.totals.params == sum(a * b + b for a, b in pairwise(widths))
    assert s.rows[-1].output_shapes == [batch, widths[-1]]
    assert sum(r.calls > 1 for r in s.rows) == (2 if reuse else 0)


def test_cpu_peak_memory_counts_tensors_alive_at_once():
    net = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(inplace=True))
    s = hs.summary(net, torch.randn(50, 100))
    one = 50 * 100 * 4
    # Linear output + ReLU output alive together (Sequential drops the older one afterwards);
    # the in-place ReLU allocates nothing; the input and the weights are not counted.
    assert s.totals.peak_memory_bytes == 2 * one
    # (the in-place ReLU's output is the Linear's memory: not counted again)
    assert s.totals.activation_bytes == 3 * one


@pytest.fixture
def dispatched(monkeypatch) -> list:
    """The operators summary's dispatch mode sees during the test (none for a layer run natively)."""
    from hookscope.summarization import _flops

    _flops.warm_up()  # its first call runs two operators under a mode, once per process
    seen: list = []
    dispatch = _flops.OpCounter.__torch_dispatch__
    monkeypatch.setattr(
        _flops.OpCounter,
        "__torch_dispatch__",
        lambda self, func, *a, **k: seen.append(func) or dispatch(self, func, *a, **k),
    )
    return seen


# Leaf layers of known built-in types run with the dispatch mode off and are counted from shapes
# (benchmark: batch_norm under a dispatch mode costs ~40 us a call). Each rule against the
# dispatcher's count, over the configurations that change which aten operators run.
NATIVE_CASES = [
    (nn.Conv1d(4, 6, 3), (2, 4, 9)),
    (nn.Conv1d(4, 6, 3), (4, 9)),  # unbatched
    (nn.Conv2d(4, 8, 3, stride=2, padding=1, dilation=1, groups=2), (2, 4, 9, 9)),
    (nn.Conv2d(4, 8, 3, padding="same", dilation=2, bias=False), (1, 4, 7, 7)),
    (nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect"), (1, 4, 7, 7)),
    (nn.Conv2d(4, 6, 3), (4, 7, 7)),  # unbatched
    (nn.Conv3d(2, 3, (1, 2, 3), stride=(1, 2, 1)), (2, 2, 4, 5, 6)),
    (nn.ConvTranspose1d(4, 2, 3, stride=2, output_padding=1), (2, 4, 5)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), (2, 4, 5, 5)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2), (4, 5, 5)),  # unbatched
    (nn.ConvTranspose3d(2, 2, 2, stride=2), (1, 2, 3, 3, 3)),
    (nn.Linear(5, 7), (5,)),
    (nn.Linear(5, 7), (3, 5)),
    (nn.Linear(5, 7, bias=False), (2, 3, 5)),
    (nn.Linear(5, 7), (2, 3, 4, 5)),
    (nn.Linear(5, 7), (0, 5)),
    (nn.BatchNorm2d(4), (2, 4, 3, 3)),
    (nn.LayerNorm(6), (2, 3, 6)),
    (nn.GroupNorm(2, 4), (2, 4, 3)),
    (nn.GELU(), (2, 3)),
    (nn.Softmax(-1), (2, 3)),
    (nn.MaxPool2d(2, return_indices=True), (1, 2, 4, 4)),
    (nn.AdaptiveAvgPool2d(1), (1, 2, 4, 4)),
    (nn.Embedding(10, 4), None),
]


@pytest.mark.parametrize(
    ("layer", "shape"), NATIVE_CASES, ids=[f"{type(m).__name__}-{s}" for m, s in NATIVE_CASES]
)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_native_leaf_rules_equal_the_dispatcher(layer, shape, train, dispatched):
    from hookscope.summarization import _flops

    assert _flops.native_rule(layer) is not None
    layer.train(train)
    x = torch.randint(0, 10, (2, 3)) if shape is None else torch.randn(shape)
    net = nn.Sequential(layer)
    ref = reference_flops(net, x).get_total_flops()
    s = hs.summary(net, x)
    assert dispatched == []  # the layer ran natively
    assert s.totals.flops == ref
    assert s.rows[1].flops == ref
    with torch.no_grad():
        out = net(x)
    if isinstance(out, tuple):
        assert s.rows[1].output_shapes["0"] == list(out[0].shape)
    else:
        assert s.rows[1].output_shapes == list(out.shape)
    if isinstance(layer, (nn.Conv2d, nn.Linear)) and x.numel():
        assert ref > 0  # the comparison is not 0 == 0


def test_layers_that_may_run_other_operators_are_counted_at_the_dispatcher(seed):
    """A built-in type with a hook of someone else's, or a subclass with its own forward, runs
    with the dispatch mode on: the matmuls its hook or forward adds are counted."""
    from hookscope.summarization import _flops

    class Wider(nn.Linear):
        def forward(self, x):
            return super().forward(x) @ torch.ones(self.out_features, 9)

    hooked = nn.Linear(4, 4)
    a = torch.randn(4, 4)
    h = hooked.register_forward_pre_hook(lambda m, args: (args[0] @ a,))
    try:
        net = nn.Sequential(hooked, Wider(4, 5))
        assert _flops.native_rule(hooked) is None and _flops.native_rule(net[1]) is None
        x = torch.randn(3, 4)
        ref = reference_flops(net, x).get_total_flops()
        s = hs.summary(net, x)
        assert s.totals.flops == ref == 2 * 3 * 4 * 4 * 2 + 2 * 3 * 4 * 5 + 2 * 3 * 5 * 9
        # the user's pre-hook runs before summary's records the call: its matmul goes to the parent
        assert [r.flops for r in s.rows] == [
            2 * 3 * 4 * 4,
            2 * 3 * 4 * 4,
            2 * 3 * 4 * 5 + 2 * 3 * 5 * 9,
        ]
    finally:
        h.remove()


def test_dispatch_mode_back_on_after_a_native_layer_raises(seed):
    """A native layer that raises must not leave the dispatch mode off for the next summary."""
    bad = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2))
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        hs.summary(bad, torch.randn(2, 4))
    att = nn.Sequential(nn.Linear(4, 8))
    x = torch.randn(2, 4)

    class MatmulOnly(nn.Module):
        def forward(self, x):
            return x @ x.T

    net = nn.Sequential(att, MatmulOnly())
    s = hs.summary(net, x)
    assert (
        s.totals.flops == reference_flops(net, x).get_total_flops() == 2 * 2 * 4 * 8 + 2 * 2 * 8 * 2
    )


MHA_CASES = [
    # (module kwargs, L, S, call kwargs, batched)
    ({}, 5, 5, {}, True),
    ({"batch_first": True}, 5, 5, {"need_weights": False}, True),
    ({}, 4, 6, {}, True),  # cross-attention: L != S
    ({"kdim": 3, "vdim": 5}, 4, 6, {}, True),
    ({"add_bias_kv": True, "add_zero_attn": True}, 5, 5, {}, True),
    ({"add_bias_kv": True}, 5, 5, {"need_weights": False}, True),
    ({"dropout": 0.5}, 5, 5, {"need_weights": False}, True),
    ({}, 5, 5, {"attn_mask": "causal", "need_weights": False}, True),
    ({}, 5, 5, {"attn_mask": "causal"}, True),
    ({"batch_first": True}, 5, 5, {"key_padding_mask": True, "average_attn_weights": False}, True),
    ({"bias": False}, 5, 5, {}, False),  # unbatched (L, E)
]


@pytest.mark.parametrize("case", MHA_CASES, ids=[str(i) for i in range(len(MHA_CASES))])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_native_multihead_attention_equals_the_dispatcher(case, train, seed, dispatched):
    from hookscope.summarization import _flops

    mkw, lq, s, ckw, batched = case
    e, n = 8, 3
    mha = nn.MultiheadAttention(e, 2, **mkw).train(train)
    assert _flops.native_rule(mha) is _flops._MHA
    kdim, vdim = mha.kdim, mha.vdim

    def shape(length: int, width: int) -> tuple[int, ...]:
        if not batched:
            return (length, width)
        return (n, length, width) if mha.batch_first else (length, n, width)

    q = torch.randn(shape(lq, e))
    k = q if (lq == s and kdim == e) else torch.randn(shape(s, kdim))
    v = q if (lq == s and vdim == e) else torch.randn(shape(s, vdim))
    ckw = dict(ckw)
    if ckw.get("attn_mask") == "causal":
        ckw["attn_mask"] = torch.triu(torch.full((lq, s), float("-inf")), 1)
    if ckw.get("key_padding_mask"):
        ckw["key_padding_mask"] = torch.zeros(n, s, dtype=torch.bool)

    class Block(nn.Module):  # calls the attention with keywords, as transformers code does
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, q, k, v):
            return self.attn(q, key=k, value=v, **ckw)[0]

    net = Block()
    ref = reference_flops(net, q, k, v).get_total_flops()
    sm = hs.summary(net, q, k, v)
    assert dispatched == []  # the attention ran natively
    assert ref > 0 and sm.totals.flops == ref and by_label(sm)["attn"].flops == ref


def test_unshared_fast_path_counts_as_the_exact_path(monkeypatch):
    """Rows of a model with nothing shared take a bottom-up count; the exact per-row path (used
    when a parameter or module is reachable twice) must give the same rows."""
    import torchvision

    from hookscope.summarization import _rows as _summary_rows

    net = torchvision.models.resnet18().eval()
    net.fc.weight.requires_grad_(False)
    x = torch.randn(1, 3, 32, 32)
    fast = hs.summary(net, x)
    monkeypatch.setattr(_summary_rows, "_tree_sizes", lambda modules: None)
    exact = hs.summary(net, x)
    key = lambda s: [(r.label, r.params, r.trainable, r.shared_params) for r in s.rows]  # noqa: E731
    assert key(fast) == key(exact)
    assert fast.rows[0].params == sum(p.numel() for p in net.parameters())
    assert fast.rows[0].trainable == fast.rows[0].params - net.fc.weight.numel()


@pytest.mark.parametrize("user_fastpath", [True, False])
def test_attention_takes_the_fast_path_only_if_the_user_has_it_on(user_fastpath, monkeypatch):
    """Inside summary a natively-run MultiheadAttention may take PyTorch's MHA fast path, as it
    would outside, but only when the user has it on; a TransformerEncoderLayer still has its
    sub-layers called (the switch is off around them); the switch is restored either way."""
    calls = []
    native = torch._native_multi_head_attention
    monkeypatch.setattr(
        torch, "_native_multi_head_attention", lambda *a, **k: calls.append(1) or native(*a, **k)
    )
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(user_fastpath)
    try:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
        x = torch.randn(2, 5, 16)
        s = hs.summary(layer, x)
        assert torch.backends.mha.get_fastpath_enabled() == user_fastpath
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert {"self_attn", "linear1", "linear2", "norm1"} <= {r.name for r in s.rows}
    assert bool(calls) == user_fastpath
    assert s.totals.flops == reference_flops(layer, x).get_total_flops()


ZERO_FLOP_LAYERS = {
    nn.BatchNorm1d: (lambda: nn.BatchNorm1d(4), (3, 4, 5)),
    nn.BatchNorm3d: (lambda: nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
    nn.ReLU: (nn.ReLU, (2, 3)),
    nn.ReLU6: (nn.ReLU6, (2, 3)),
    nn.LeakyReLU: (nn.LeakyReLU, (2, 3)),
    nn.SiLU: (nn.SiLU, (2, 3)),
    nn.Sigmoid: (nn.Sigmoid, (2, 3)),
    nn.Tanh: (nn.Tanh, (2, 3)),
    nn.Hardswish: (nn.Hardswish, (2, 3)),
    nn.Hardsigmoid: (nn.Hardsigmoid, (2, 3)),
    nn.ELU: (nn.ELU, (2, 3)),
    nn.Dropout: (lambda: nn.Dropout(0.3), (4, 5)),
    nn.Identity: (nn.Identity, (2, 3)),
    nn.Flatten: (nn.Flatten, (2, 3, 4)),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(2), (1, 2, 6)),
    nn.MaxPool3d: (lambda: nn.MaxPool3d(2), (1, 1, 4, 4, 4)),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(2), (1, 2, 6)),
    nn.AvgPool2d: (lambda: nn.AvgPool2d(2, ceil_mode=True), (1, 2, 5, 5)),
    nn.AvgPool3d: (lambda: nn.AvgPool3d(2), (1, 1, 4, 4, 4)),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(3), (1, 2, 7)),
    nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(2), (1, 1, 5, 5, 5)),
}


def test_every_native_type_is_tested_against_the_dispatcher():
    """Every type summary runs natively has a case here or in NATIVE_CASES/MHA_CASES."""
    from hookscope.summarization import _flops

    covered = {type(m) for m, _ in NATIVE_CASES} | set(ZERO_FLOP_LAYERS) | {nn.MultiheadAttention}
    assert set(_flops._NATIVE) == covered


@pytest.mark.parametrize("cls", list(ZERO_FLOP_LAYERS), ids=lambda c: c.__name__)
def test_zero_flop_native_layers_equal_the_dispatcher(cls, seed):
    make, shape = ZERO_FLOP_LAYERS[cls]
    for train in (False, True):
        net = nn.Sequential(make()).train(train)
        x = torch.randn(shape)
        s = hs.summary(net, x)
        assert s.totals.flops == reference_flops(net, x).get_total_flops() == 0
        with torch.no_grad():
            assert s.rows[1].output_shapes == list(net(x).shape)


def test_summary_says_which_columns_include_the_children():
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Linear(3, 2))
    s = hs.summary(net, torch.zeros(1, 4))
    rows = {r.name: r for r in s.rows}
    # what the legend claims, on the numbers: params inclusive, FLOPs exclusive
    assert rows["0"].params == rows["0.0"].params == 15 and rows["0"].flops == 0
    assert rows["0.0"].flops == 2 * 4 * 3 and sum(r.flops for r in s.rows) == s.totals.flops
    text = str(s)
    assert "Params, Time ms: inclusive (the module and its children)" in text
    assert "FLOPs: exclusive (what the row ran itself; rows add up to the total; -- = none)" in text
    only_shapes = s.to_text(columns=["type", "output"])
    assert "inclusive" not in only_shapes and "exclusive" not in only_shapes
    assert "Params: inclusive" in s.to_text(columns=["params"])


def test_to_text_below_the_narrowest_table_raises_with_the_width_that_fits():
    """width=0 used to print a lone "…" and width=15 rows wider than 15: a width the table cannot
    fit raises, naming the narrowest width; at that width every line fits and a row fills it."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    s = hs.summary(net, torch.randn(1, 3, 8, 8), columns=["type", "output", "params", "flops"])
    with pytest.raises(ValueError, match=r"^width=0 is narrower than .* use width >= (\d+)") as e:
        s.to_text(width=0)
    narrowest = int(str(e.value).rsplit(">= ", 1)[1].split()[0])
    lines = s.to_text(width=narrowest, ascii=True).splitlines()
    assert max(len(line) for line in lines) == narrowest
    with pytest.raises(ValueError, match=rf"^width={narrowest - 1} is narrower .*>= {narrowest} "):
        s.to_text(width=narrowest - 1)
    with pytest.raises(TypeError, match=r"^width must be an int"):
        s.to_text(width=40.0)  # type: ignore[arg-type]


def test_summary_leaves_a_layer_s_python_state_as_found():
    """A layer whose forward counts its calls: the summary's run leaves the counter, the list it
    appends to and its tensor attribute as found, so the user's next forward is the first."""
    from helpers.common import Counting

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), Counting(3))
    x = torch.randn(2, 3)
    expected = copy.deepcopy(net)(x)
    hs.summary(net, x)
    assert net[1].state() == (False, 0, [], 0.0)
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
