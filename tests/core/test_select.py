"""Layer selection: names, globs, types, instances, predicates; errors with suggestions."""

from __future__ import annotations

import pytest
import torch.nn as nn
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st

import hookscope as hs
from hookscope.core._select import suggest


@pytest.fixture(scope="module")
def resnet():
    return torchvision.models.resnet18(weights=None)


def test_exact_glob_type_instance_predicate(resnet):
    assert list(hs.find(resnet, "layer2.0.conv1")) == ["layer2.0.conv1"]
    assert list(hs.find(resnet, "")) == [""]
    assert list(hs.find(resnet, "layer*.conv2")) == [
        f"layer{i}.{j}.conv2" for i in range(1, 5) for j in range(2)
    ]
    assert list(hs.find(resnet, nn.AdaptiveAvgPool2d)) == ["avgpool"]
    assert list(hs.find(resnet, resnet.layer3[1].bn2)) == ["layer3.1.bn2"]
    assert list(hs.find(resnet, lambda n, m: n.endswith("downsample"))) == [
        "layer2.0.downsample",
        "layer3.0.downsample",
        "layer4.0.downsample",
    ]
    # union of selectors, returned in model order, without duplicates
    got = hs.find(resnet, "fc", "conv1", nn.Linear)
    assert list(got) == ["conv1", "fc"]


def test_leaves(resnet):
    leaves = hs.find(resnet, leaves=True)
    assert all(next(m.children(), None) is None for m in leaves.values())
    assert "layer1" not in leaves and "layer1.0.conv1" in leaves
    assert list(hs.find(resnet, "layer4.1*", leaves=True)) == [
        "layer4.1.conv1",
        "layer4.1.bn1",
        "layer4.1.relu",
        "layer4.1.conv2",
        "layer4.1.bn2",
    ]


def test_unknown_name_lists_closest(resnet):
    with pytest.raises(hs.LayerNotFoundError) as info:
        hs.find(resnet, "layer3.0.conv3")
    msg = str(info.value)
    assert "no layer named 'layer3.0.conv3' in ResNet" in msg
    assert "'layer3.0.conv2'" in msg and "'layer3.0.conv1'" in msg
    assert isinstance(info.value, KeyError) and isinstance(info.value, hs.HookscopeError)


def test_other_selectors_that_match_nothing(resnet):
    with pytest.raises(hs.LayerNotFoundError, match="pattern 'layer9.*' matched no layer"):
        hs.find(resnet, "layer9.*")
    with pytest.raises(
        hs.LayerNotFoundError, match="no layer of type LSTM.*types present: .*Conv2d"
    ):
        hs.find(resnet, nn.LSTM)
    with pytest.raises(hs.LayerNotFoundError, match="not a submodule"):
        hs.find(resnet, nn.Linear(1, 1))
    with pytest.raises(TypeError, match="a layer selector must be"):
        hs.find(resnet, 3)


def test_errors_reach_every_feature(resnet):
    with pytest.raises(hs.LayerNotFoundError, match="closest valid names: 'avgpool'"):
        hs.capture(resnet, ["avgpoo"])
    with pytest.raises(hs.LayerNotFoundError):
        hs.edit(resnet, {"fcc": hs.ops.zero()})
    with pytest.raises(hs.LayerNotFoundError, match="closest.*'fc.bias'"):
        hs.edit_grads(resnet, {"fc.bia": hs.ops.zero()})
    assert hs.hooks_on(resnet) == []


_NAMES = [n for n, _ in torchvision.models.resnet18(weights=None).named_modules() if n]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_NAMES), st.data())
def test_single_typo_suggests_the_intended_name(name, data):
    i = data.draw(st.integers(0, len(name) - 1))
    ch = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz"))
    typo = name[:i] + ch + name[i + 1 :]
    if typo in _NAMES:
        return
    suggestions = suggest(typo, _NAMES)
    assert name in suggestions, (typo, suggestions)


@pytest.mark.parametrize(
    "empty", [{}, [], (), set(), (n for n in ())], ids=["dict", "list", "tuple", "set", "generator"]
)
def test_an_empty_selection_raises_in_every_form(resnet, empty):
    with pytest.raises(hs.LayerNotFoundError, match="layers is empty: it selects no layer"):
        hs.capture(resnet, empty)
    assert hs.hooks_on(resnet) == []


def test_a_selection_that_is_not_a_selector_names_the_argument_and_the_forms(resnet):
    for bad in (0, 2.5, b"fc"):
        with pytest.raises(TypeError, match=r"^layers must be a layer name, a glob, .* got"):
            hs.capture(resnet, bad)
    with pytest.raises(hs.LayerNotFoundError, match="a key of edits is empty"):
        hs.edit(resnet, {(): hs.ops.zero()})


def test_entry_points_name_a_bad_model_or_flag_at_the_call(resnet):
    for call in (
        lambda: hs.capture("resnet", "fc"),
        lambda: hs.edit(None, {"fc": hs.ops.zero()}),
        lambda: hs.trace([resnet]),
        lambda: hs.observe(resnet.state_dict(), "fc", print),
    ):
        with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module .*; got "):
            call()
    with pytest.raises(TypeError, match="capture: grads must be True or False; got str"):
        hs.capture(resnet, "fc", grads="yes")
    with pytest.raises(TypeError, match="observe: fn must be a function"):
        hs.observe(resnet, "fc", None)
    assert hs.hooks_on(resnet) == []
