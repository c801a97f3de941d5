"""A CAM leaves the model as found and says so when its maps would depend on chance or on the
batch: every method runs with the model's buffers restored, refuses a forward that draws random
numbers, and warns about batch-norm layers computing batch statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs

# these tests give every method a target; EigenCAM ignores it, which it says (tested in
# test_cam_eigencam_target_s20.py)
pytestmark = pytest.mark.filterwarnings("ignore:EigenCAM. target=.* is ignored")

METHODS = sorted(hs.cam_methods())


def _bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).train()


def _kwargs(method: str) -> dict:
    return {"progress": False} if method == "scorecam" else {}


@pytest.mark.parametrize("method", METHODS)
def test_cam_on_a_train_mode_batchnorm_model_warns_and_leaves_the_statistics(method):
    """A model left in train mode: the running statistics are left as found (ScoreCAM used to
    advance num_batches_tracked 0 -> 3, GradCAM 0 -> 1) and a CAMWarning names the layer and
    says to call model.eval(); the map equals the map of a fresh copy of the model."""
    net = _bn_net()
    ref = _bn_net()
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.warns(hs.HookscopeWarning, match=r"batch statistics .*'1'.*model\.eval\(\)"):
        m = hs.get_cam(method)(net, "2", **_kwargs(method))(x, 0)
    after = net.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
    assert net[1].num_batches_tracked.item() == 0
    # the call on a copy still at its first batch gives the same map: nothing was carried over
    with pytest.warns(hs.HookscopeWarning):
        again = hs.get_cam(method)(ref, "2", **_kwargs(method))(x, 0)
    torch.testing.assert_close(m, again)


def test_cam_in_eval_mode_or_stopped_before_the_batchnorm_does_not_warn():
    """The model in eval mode, or EigenCAM whose forward stops before the batch-norm layer runs:
    no warning (pytest turns warnings into errors)."""
    x = torch.randn(2, 3, 8, 8)
    hs.GradCAM(_bn_net().eval(), "2")(x, 0)
    net = _bn_net()
    hs.EigenCAM(net, "0")(x)
    assert net[1].num_batches_tracked.item() == 0


@pytest.mark.parametrize("method", METHODS)
def test_cam_with_dropout_in_train_mode_is_refused(method):
    """A forward that draws random numbers (dropout in train mode) gives a different map on every
    call (GradCAM's differed by 0.29 on a [0, 1] map); every method refuses it, naming the modules
    in training mode and the fix."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).train()
    x = torch.randn(2, 3, 8, 8)
    cam = hs.get_cam(method)(net, "1", **_kwargs(method))
    if method == "eigencam":  # its forward stops at the layer, before the dropout: repeatable
        torch.testing.assert_close(cam(x, 0), cam(x, 0), rtol=0, atol=0)
        return
    with pytest.raises(hs.CAMError, match=r"draws random numbers.*model\.eval\(\)"):
        cam(x, 0)
    net.eval()
    torch.testing.assert_close(cam(x, 0), cam(x, 0), rtol=0, atol=0)


class _AlwaysDrops(nn.Module):
    """Dropout called as a function on whatever the mode: draws in eval mode too."""

    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


def test_cam_of_an_eval_model_that_draws_names_the_module_not_eval():
    """An eval() model whose code draws whatever the mode: the refusal names the module that
    draws and the functional fix, not "call model.eval() first" (already applied)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), _AlwaysDrops(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 3),
    ).eval()  # fmt: skip
    cam = hs.get_cam("gradcam")(net, "1")
    with pytest.raises(hs.CAMError) as err:
        cam(torch.randn(2, 3, 8, 8), 0)
    msg = str(err.value)
    assert "in the forward of '2' (_AlwaysDrops)" in msg and "no module is in training mode" in msg
    assert "call model.eval() first" not in msg


@pytest.mark.parametrize("method", ["gradcam", "scorecam"])
def test_cam_leaves_a_layer_s_python_state_as_found_and_each_map_starts_from_it(method):
    """A layer whose forward counts its calls (and scales its output by the count): the maps of
    a second call equal the first's and a fresh copy's, and the counter, the list it appends to
    and its tensor attribute are as found."""
    from helpers.common import Counting

    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), Counting(4 * 6 * 6), nn.Linear(144, 3)
        ).eval()

    net, x = build(), torch.randn(2, 3, 8, 8)
    cam = hs.cam_methods()[method]
    first = cam(net, "0", **_kwargs(method))(x, target=1)
    again = cam(net, "0", **_kwargs(method))(x, target=1)
    fresh = cam(build(), "0", **_kwargs(method))(x, target=1)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(fresh, first, rtol=0, atol=0)
    assert net[3].state() == (False, 0, [], 0.0)


@pytest.mark.parametrize("method", ["gradcam", "gradcam++"])
def test_a_layer_that_runs_twice_in_one_forward_is_refused_naming_it(method):
    """A convolution whose weights are shared (called twice): the map silently came from its
    last call; refused, naming the layer and what to pick instead."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.sh = nn.Conv2d(3, 3, 3, padding=1)
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.sh(torch.relu(self.sh(x))))

    m = Shared().eval()
    with pytest.raises(hs.CAMError, match="'sh' ran more than once"):
        hs.cam_methods()[method](m, "sh")(torch.randn(2, 3, 8, 8), target=[0, 1])
