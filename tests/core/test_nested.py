"""Walking nested outputs: tuples, lists, dicts, namedtuples, dataclasses, ModelOutput, Nones."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch
import torch.nn as nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

import hookscope as hs
from hookscope.core._nested import describe, iter_tensors, map_tensors, tensors_of

Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    aux: list
    note: str = "x"


def test_iter_and_map_preserve_structure_and_types():
    t = torch.arange(3.0)
    obj = {"a": (t, None, 3), "b": [Pair(t, t * 2)], "c": Out(t, [t, "s"]), "d": OrderedDict(z=t)}
    paths = [p for p, _ in iter_tensors(obj)]
    assert paths == [
        ("a", 0),
        ("b", 0, 0),
        ("b", 0, 1),
        ("c", "logits"),
        ("c", "aux", 0),
        ("d", "z"),
    ]
    new = map_tensors(lambda x: x + 1, obj)
    assert (
        isinstance(new["b"][0], Pair)
        and isinstance(new["c"], Out)
        and isinstance(new["d"], OrderedDict)
    )
    assert (
        new["a"][1] is None and new["a"][2] == 3 and new["c"].note == "x" and new["c"].aux[1] == "s"
    )
    assert torch.equal(new["b"][0].right, t * 2 + 1)
    assert torch.equal(obj["c"].logits, t)  # the original is untouched
    assert map_tensors(lambda x: x, obj, other=lambda _: None)["a"][2] is None


def test_tensors_of_and_the_fast_paths_agree_with_the_general_walk():
    """``tensors_of`` (no paths) gives iter_tensors' tensors in its order, and map_tensors' fast
    paths for plain tuples, dicts and scalar leaves give what the general path gives: subclasses
    of tensors and containers, scalars with ``other``, nested plain and exotic containers."""

    class Sub(torch.Tensor):
        pass

    class MyList(list):
        pass

    t = torch.arange(3.0)
    p = nn.Parameter(torch.ones(2))
    s = t.as_subclass(Sub)
    mo = BaseModelOutputWithPooling(last_hidden_state=t, pooler_output=p)
    obj = (
        {"x": t, "n": None, "d": torch.float16, "i": 3, "f": 0.5, "b": True},
        [p, (s, "s")],
        MyList([t, {"deep": (p,)}]),
        Pair(s, OrderedDict(z=t)),
        Out(t, [p]),
        mo,
        torch.device("cpu"),
    )
    want = [x for _, x in iter_tensors(obj)]
    got = tensors_of(obj)
    assert len(got) == len(want) == 11 and all(a is b for a, b in zip(got, want))
    assert tensors_of(t) == [t] and tensors_of(None) == [] and tensors_of(3) == []
    seen = []
    new = map_tensors(lambda x: seen.append(x) or x * 2, obj, other=lambda v: ("other", v))
    assert [id(x) for x in seen] == [id(x) for x in want]
    assert new[0]["n"] is None and new[0]["i"] == ("other", 3) and new[0]["b"] == ("other", True)
    assert new[0]["d"] == ("other", torch.float16) and new[6] == ("other", torch.device("cpu"))
    assert type(new) is tuple and type(new[0]) is dict and type(new[3]) is Pair
    assert type(new[1][1]) is tuple and torch.equal(new[0]["x"], t * 2)
    assert isinstance(new[3].right, OrderedDict) and type(new[5]) is BaseModelOutputWithPooling
    assert list(new[0]) == ["x", "n", "d", "i", "f", "b"]  # the dict's order kept


def test_model_output_roundtrip():
    mo = BaseModelOutputWithPooling(
        last_hidden_state=torch.ones(1, 2, 3), pooler_output=torch.zeros(1, 3)
    )
    new = map_tensors(lambda x: x * 2, mo)
    assert type(new) is BaseModelOutputWithPooling
    assert torch.equal(new.last_hidden_state, torch.full((1, 2, 3), 2.0))
    assert torch.equal(new["last_hidden_state"], new[0])
    assert [p for p, _ in iter_tensors(mo)] == [("last_hidden_state",), ("pooler_output",)]
    assert describe(mo) == "last_hidden_state: (1, 2, 3), pooler_output: (1, 3)"


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        out, (_h, c) = self.lstm(x)
        return self.head(out[:, -1]) + c.sum()


def test_capture_lstm_tuple_output_with_grads():
    torch.manual_seed(0)
    m = LSTMNet()
    x = torch.randn(2, 5, 3)
    with hs.capture(m, "lstm", grads=True) as cap:
        m(x).sum().backward()
    out, (_h, c) = cap["lstm"]
    ref_out, (_ref_h, ref_c) = m.lstm(x)
    assert torch.equal(out, ref_out) and torch.equal(c, ref_c)
    g_out, (g_h, g_c) = cap.grads["lstm"]
    r_out, r_c = torch.autograd.grad(
        m.head(ref_out[:, -1]).sum() + 2 * ref_c.sum(), [ref_out, ref_c]
    )
    assert torch.allclose(g_out, r_out) and torch.allclose(g_c, r_c)
    assert g_h is None  # h is not used by the loss: no gradient, not a fake zero


def test_capture_hf_model_output_of_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
    )
    bert = BertModel(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    with hs.capture(bert, ["", "encoder.layer.1", "pooler"], inputs=True) as cap:
        out = bert(input_ids=ids, attention_mask=mask)
    assert type(cap[""]) is type(out)
    assert torch.equal(cap[""].last_hidden_state, out.last_hidden_state)
    assert torch.equal(cap["pooler"], out.pooler_output)
    assert torch.equal(cap.inputs[""].kwargs["input_ids"], ids)
    layer1 = cap["encoder.layer.1"]
    first = layer1[0] if isinstance(layer1, (tuple, list)) else layer1
    assert torch.equal(first, out.last_hidden_state)
