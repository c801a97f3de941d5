"""hs.compare and hs.record refuse, by name and with the fix, what they cannot compare as asked:
arguments of the wrong type or value, a loss other than the recorded run's, a record of several
forward passes, a names= mapping to modules that do not exist, gradients asked for where none can
be made."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


class _Port(nn.Module):
    """The same function as _net() under other module names."""

    def __init__(self, a: nn.Sequential) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = copy.deepcopy(a[0]), nn.ReLU(), copy.deepcopy(a[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _record(a: nn.Module, folder, loss=None, calls: int = 1) -> None:
    with hs.record(a, folder):
        for _ in range(calls):
            out = a(X)
            if loss is not None:
                loss(out).backward()
    a.zero_grad(set_to_none=True)


# -- the loss ----------------------------------------------------------------------------------
def test_a_loss_other_than_the_recorded_one_is_refused_naming_loss_fn(tmp_path):
    a = _net()
    _record(a, tmp_path / "rec", loss=lambda o: o.sum())
    b = copy.deepcopy(a)
    # the gradient (o**2).sum() gives at the recorded output, against the recorded ones(...)
    out = a(X).detach()
    err = float((2 * out - 1).norm() / torch.ones_like(out).norm())
    with pytest.raises(hs.CompareError) as info:
        hs.compare(tmp_path / "rec", b, X, loss_fn=lambda o: (o**2).sum())
    msg = str(info.value)
    assert "loss_fn" in msg and "a:" in msg and f"{err:.2e}" in msg, msg
    # the recorded loss itself passes, and a record of b against live a is checked the same way
    assert hs.compare(tmp_path / "rec", b, X, loss_fn=lambda o: o.sum()).culprit is None
    with pytest.raises(hs.CompareError, match=r"b:.*loss_fn"):
        hs.compare(b, tmp_path / "rec", X, loss_fn=lambda o: o.mean())


def test_the_recorded_loss_passes_the_check_for_a_record_made_under_autocast(tmp_path):
    a = _net()
    loss = lambda o: o.float().logsumexp(-1).mean()  # noqa: E731
    with hs.record(a, tmp_path / "rec"), torch.autocast("cpu", dtype=torch.bfloat16):
        loss(a(X)).backward()
    a.zero_grad(set_to_none=True)
    r = hs.compare(tmp_path / "rec", copy.deepcopy(a), X, loss_fn=loss, autocast=torch.bfloat16)
    assert r.culprit is None and r.rows[0].grad_error == 0.0
    with pytest.raises(hs.CompareError, match="another loss"):
        hs.compare(tmp_path / "rec", copy.deepcopy(a), X, loss_fn=lambda o: o.float().sum())


def test_a_loss_on_another_output_of_the_model_is_refused(tmp_path):
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.fc(x), "hidden": torch.tanh(self.fc.bias.sum() * x)}

    torch.manual_seed(0)
    a = Two()
    with hs.record(a, tmp_path / "rec"):
        a(X)["logits"].sum().backward()
    a.zero_grad(set_to_none=True)
    b = copy.deepcopy(a)
    assert hs.compare(tmp_path / "rec", b, X, loss_fn=lambda o: o["logits"].sum()).culprit is None
    with pytest.raises(hs.CompareError, match=r"by inf \(other leaves"):
        hs.compare(tmp_path / "rec", b, X, loss_fn=lambda o: o["hidden"].sum())


def test_loss_fn_against_a_record_made_without_backward_is_refused(tmp_path):
    a = _net()
    _record(a, tmp_path / "fwd")
    with pytest.raises(hs.CompareError, match=r"no gradients.*loss_fn"):
        hs.compare(tmp_path / "fwd", copy.deepcopy(a), X, loss_fn=lambda o: o.sum())


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_compare_with_loss_fn_where_autograd_is_off_is_a_clear_error(mode):
    a = _net()
    b = copy.deepcopy(a)
    with (
        pytest.raises(hs.CompareError, match=rf"torch\.{mode}\(\).*loss_fn"),
        getattr(torch, mode)(),
    ):
        hs.compare(a, b, X, loss_fn=lambda o: o.sum())
    # without loss_fn the forward comparison still runs there, exactly
    with torch.inference_mode():
        assert [r.error for r in hs.compare(a, b, X).rows] == [0.0] * 4


@pytest.mark.parametrize(
    ("loss", "what"),
    [
        ("sum", "not callable"),
        (lambda o: o, r"a tensor of shape \(3, 2\)"),
        (lambda o: 1.0, "a float"),
        (lambda o: o.sum().detach(), "does not require grad"),
    ],
)
def test_a_loss_fn_that_gives_no_scalar_to_backward_is_refused(loss, what):
    a = _net()
    with pytest.raises((hs.CompareError, TypeError), match=rf"loss_fn.*{what}"):
        hs.compare(a, copy.deepcopy(a), X, loss_fn=loss)


# -- the record --------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [None, ["0", "2"]])
def test_a_record_of_two_forward_passes_is_refused_naming_the_count(tmp_path, layers):
    """Refused when the block ends (it was written, and refused by compare later), nothing
    written."""
    a = _net()
    refused = pytest.raises(hs.CompareError, match=r"ran 2 times inside the block.*one forward")
    with refused, hs.record(a, tmp_path / "rec", layers=layers):
        a(X)
        a(X + 1)
    assert not (tmp_path / "rec" / "index.json").exists()


def test_inputs_other_than_a_recorded_b_ones_are_refused(tmp_path):
    a = _net()
    _record(a, tmp_path / "rec")
    with pytest.raises(hs.CompareError, match="inputs given differ"):
        hs.compare(copy.deepcopy(a), tmp_path / "rec", X + 1)
    assert hs.compare(copy.deepcopy(a), tmp_path / "rec", X).rows[0].error == 0.0


def test_a_folder_that_is_not_a_record_is_refused(tmp_path):
    a = _net()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.json").write_text("{not json")
    with pytest.raises(hs.CompareError, match="not a record written by hs.record"):
        hs.compare(tmp_path / "bad", a, X)
    (tmp_path / "file").write_text("x")
    with pytest.raises(hs.CompareError, match="not a folder"):
        hs.record(a, tmp_path / "file")
    with pytest.raises(TypeError, match="folder must be"):
        hs.record(a, 3)  # type: ignore[arg-type]


# -- the other arguments -----------------------------------------------------------------------
def test_names_mapping_to_a_module_b_lacks_is_refused_with_the_closest_names():
    a = _net()
    b = _Port(a)
    with pytest.raises(hs.CompareError, match=r"'fc9'.*not a module of b.*'fc1'"):
        hs.compare(a, b, X, names={"0": "fc9", "1": "act", "2": "fc2"})
    with pytest.raises(hs.CompareError, match=r"'9'.*not a module of a.*'0'"):
        hs.compare(a, b, X, names={"9": "fc1", "1": "act", "2": "fc2"})
    with pytest.raises(hs.CompareError, match=r"'fc9'.*not a module of b"):
        hs.compare(a, b, X, names=lambda n: {"0": "fc9", "1": "act", "2": "fc2"}.get(n, n))
    r = hs.compare(a, b, X, names={"0": "fc1", "1": "act", "2": "fc2"})
    assert [x.b_name for x in r.rows] == [None, "fc1", "act", "fc2"] and r.unmatched == []


@pytest.mark.parametrize("names", [["fc1", "act", "fc2"], "fc1", {0: "fc1"}, {"0": 1}])
def test_names_of_the_wrong_type_is_a_one_line_type_error(names):
    a = _net()
    with pytest.raises(
        TypeError, match=r"^hs\.compare: names= must be a dict .*or a function"
    ) as e:
        hs.compare(a, _Port(a), X, names=names)
    assert "\n" not in str(e.value)


def test_no_inputs_for_a_live_model_is_a_clear_error(tmp_path):
    a = _net()
    _record(a, tmp_path / "rec")
    with pytest.raises(hs.CompareError, match=r"b \(Sequential\) cannot take the inputs given"):
        hs.compare(tmp_path / "rec", copy.deepcopy(a))
    with pytest.raises(hs.CompareError, match=r"a \(Sequential\) cannot take the inputs given"):
        hs.compare(a, copy.deepcopy(a), X, X)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"max_bytes": -1}, hs.CompareError, r"max_bytes=-1.*0 or more"),
        ({"max_bytes": math.nan}, TypeError, r"max_bytes= must be an int"),
        ({"max_bytes": "1MB"}, TypeError, r"max_bytes= must be an int"),
        ({"max_bytes": True}, TypeError, r"max_bytes= must be an int"),
        ({"autocast": "bf16"}, TypeError, r"autocast= must be a torch\.dtype"),
        ({"autocast": torch.float64}, hs.CompareError, r"autocast=torch\.float64.*bfloat16"),
        ({"autocast": torch.int32}, hs.CompareError, r"autocast=torch\.int32.*bfloat16"),
    ],
)
def test_max_bytes_and_autocast_out_of_range_are_refused_by_name(kwargs, err, match):
    a = _net()
    with pytest.raises(err, match=match):
        hs.compare(a, copy.deepcopy(a), X, **kwargs)


def test_autocast_for_a_recorded_b_and_a_model_against_itself_are_refused(tmp_path):
    a = _net()
    _record(a, tmp_path / "rec")
    with pytest.raises(hs.CompareError, match="autocast= runs a live b"):
        hs.compare(a, tmp_path / "rec", X, autocast=torch.bfloat16)
    with pytest.raises(hs.CompareError, match="the same model object"):
        hs.compare(a, a, X)


# -- loss_reduction ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["avg", "MEAN", 1])
def test_a_loss_reduction_that_is_no_choice_is_refused_naming_the_choices(tmp_path, value):
    a = _net()
    _record(a, tmp_path / "rec", loss=lambda o: o.sum())
    with pytest.raises(
        hs.CompareError, match=rf"loss_reduction={value!r} is not one of 'mean', 'sum'"
    ):
        hs.compare(tmp_path / "rec", copy.deepcopy(a), X, loss_reduction=value)
    with pytest.raises(hs.CompareError, match="is not one of 'mean', 'sum'"):
        hs.compare(copy.deepcopy(a), tmp_path / "rec", X, loss_reduction=value)


def test_a_loss_reduction_that_is_no_choice_is_refused_between_live_models():
    a = _net()
    with pytest.raises(hs.CompareError, match="loss_reduction='avg' is not one of 'mean', 'sum'"):
        hs.compare(a, copy.deepcopy(a), X, loss_reduction="avg")


@pytest.mark.parametrize("value", ["mean", "sum"])
def test_a_loss_reduction_with_no_record_of_several_ranks_is_refused_not_ignored(tmp_path, value):
    a = _net()
    _record(a, tmp_path / "rec", loss=lambda o: o.sum())
    with pytest.raises(hs.CompareError, match=rf"loss_reduction={value!r} applies only to a rec"):
        hs.compare(a, copy.deepcopy(a), X, loss_reduction=value)
    with pytest.raises(hs.CompareError, match="neither a nor b is one; leave out loss_reduction"):
        hs.compare(tmp_path / "rec", copy.deepcopy(a), X, loss_reduction=value)


def test_the_loss_reduction_check_refuses_only_where_it_would_be_ignored(tmp_path):
    """check_reduction itself (what compare calls at entry): a value given is refused unless a
    side is a record of several ranks; not given (None) passes."""
    from hookscope.compare._checks import check_reduction

    a = _net()
    _record(a, tmp_path / "one", loss=lambda o: o.sum())
    ranks = tmp_path / "ranks"
    for r in range(2):  # the layout hs.record writes on 2 ranks
        (ranks / f"rank{r}").mkdir(parents=True)
        (ranks / f"rank{r}" / "index.json").write_text("{}")
    check_reduction(None, a, tmp_path / "one")
    for value in ("mean", "sum"):
        check_reduction(value, ranks, a)
        check_reduction(value, str(tmp_path / "one"), ranks)
        for x, y in ((a, a), (tmp_path / "one", a), (a, str(tmp_path / "one"))):
            with pytest.raises(hs.CompareError, match="applies only to a record made on several"):
                check_reduction(value, x, y)
    with pytest.raises(hs.CompareError, match="'avg' is not one of 'mean', 'sum'"):
        check_reduction("avg", ranks, a)


# -- a record of some layers -------------------------------------------------------------------
def test_a_record_without_the_model_call_warns_that_its_loss_cannot_be_checked(tmp_path):
    """A record of layers that leave out the model itself holds no model output to check loss_fn
    at: a record made with another loss is not accepted silently (a warning naming the fix), and
    with the model recorded the same mismatch is refused."""
    a = _net()
    with hs.record(a, tmp_path / "layers", layers=["0", "2"]):
        a(X).sum().backward()
    a.zero_grad(set_to_none=True)
    other_loss = lambda o: (o**2).sum()  # noqa: E731
    with pytest.warns(hs.HookscopeWarning) as caught:
        r = hs.compare(tmp_path / "layers", copy.deepcopy(a), X, loss_fn=other_loss)
    (w,) = [w for w in caught if "loss_fn cannot be checked" in str(w.message)]
    msg = str(w.message)
    assert "record a" in msg and "layers=" in msg and "layers=['', ...]" in msg, msg
    assert w.filename == __file__  # points at the call of hs.compare
    # what it would have hidden: every gradient differs from the live run's
    assert all(row.grad_error > 0.5 for row in r.rows)
    with hs.record(a, tmp_path / "root", layers=["", "0", "2"]):
        a(X).sum().backward()
    a.zero_grad(set_to_none=True)
    with pytest.raises(hs.CompareError, match="made with another loss"):
        hs.compare(tmp_path / "root", copy.deepcopy(a), X, loss_fn=other_loss)


def test_a_record_without_the_model_call_does_not_take_other_inputs_silently(tmp_path):
    a = _net()
    with hs.record(a, tmp_path / "layers", layers=["0", "2"]):
        a(X)
    with pytest.warns(hs.HookscopeWarning, match="inputs.*cannot be checked.*layers"):
        hs.compare(tmp_path / "layers", copy.deepcopy(a), X + 1)


def test_a_record_whose_model_call_cannot_be_joined_warns_that_its_loss_cannot_be_checked():
    """A record of several ranks whose model output could not be joined (the row's note): the
    loss check warns rather than passing silently."""
    from hookscope.compare._checks import check_loss
    from hookscope.compare._run import CallRec, RunRecord

    root = CallRec("", 0, 0, None)
    rec = RunRecord(
        calls=[root],
        by_key={("", 0): 0},
        param_grads={},
        dtype=torch.float32,
        has_grads=True,
        world=2,
        notes={0: "cannot be joined: output 0 differs across ranks"},
    )
    with pytest.warns(
        hs.HookscopeWarning, match=r"record a: the model's own call cannot be joined"
    ):
        check_loss(rec, "a", lambda o: o.sum(), torch.device("cpu"))


def test_names_mapping_two_modules_of_a_to_one_of_b_or_misbehaving_is_refused():
    """``{"0": "2"}`` left A's own "2" mapped to B's "2" as well: B's "2" was paired twice (an
    exact copy named its root); refused by name, as a function that raises or returns no name."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    b = copy.deepcopy(a)
    x = torch.randn(2, 4)
    with pytest.raises(hs.CompareError, match=r"maps A's modules '0' and '2' both to B's '2'"):
        hs.compare(a, b, x, names={"0": "2"})
    assert hs.compare(a, b, x, names={"0": "2", "2": "0"}).culprit is not None  # a swap: fine
    with pytest.raises(hs.CompareError, match=r"names= raised KeyError .* for A's module"):
        hs.compare(a, b, x, names=lambda n: {"": ""}[n])
    with pytest.raises(hs.CompareError, match=r"names= returned 3 \(int\)"):
        hs.compare(a, b, x, names=lambda n: 3)
