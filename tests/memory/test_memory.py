"""memory_profile: saved bytes per module, exact against an independent saved_tensors_hooks count;
plans whose predicted drop equals the drop measured after apply_checkpointing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.saved_ref import reference_saved


def _step(model, *inputs, loss_fn=None, **kwargs):
    def run():
        out = model(*inputs, **kwargs)
        loss = loss_fn(out) if loss_fn else out.float().sum()
        loss.backward()

    return run


def check_exact(model, *inputs, loss_fn=None, **kwargs):
    ref_model = copy.deepcopy(model)  # BatchNorm statistics and grads of the original untouched
    expected = reference_saved(ref_model, _step(ref_model, *inputs, loss_fn=loss_fn, **kwargs))
    grads = [p.grad for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    prof = hs.memory_profile(model, *inputs, loss_fn=loss_fn, **kwargs)
    assert prof.total_saved_bytes == expected
    # the rows and what the loss saved add up to it, nothing counted twice; the root's total is
    # the model's part of the run
    assert sum(r.saved_bytes for r in prof.rows) + prof.loss_saved_bytes == expected
    assert prof[""].saved_bytes_total + prof.loss_saved_bytes == expected
    for r in prof.rows:  # a parent's total is its own plus its children's totals
        kids = (
            [
                s
                for s in prof.rows
                if s.name.startswith(r.name + ".") and "." not in s.name[len(r.name) + 1 :]
            ]
            if r.name
            else [s for s in prof.rows if s.name and "." not in s.name]
        )
        assert r.saved_bytes_total == r.saved_bytes + sum(k.saved_bytes_total for k in kids)
    # the model is left as found
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))
    return prof


def _resnet18():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def test_resnet18_exact_and_layer1_example():
    m = _resnet18()
    x = torch.randn(2, 3, 32, 32)
    prof = check_exact(m, x)
    # hand count: conv1 saves the input image (2*3*32*32 floats); bn1 its conv output
    assert prof["conv1"].saved_bytes == 2 * 3 * 32 * 32 * 4
    # bn1 its input (conv1's output) and the batch mean and inverse std per channel
    assert prof["bn1"].saved_bytes == 2 * 64 * 16 * 16 * 4 + 2 * 64 * 4
    # the weights conv1 saves are reported apart
    assert prof["conv1"].param_saved_bytes == m.conv1.weight.numel() * 4
    assert prof.param_bytes == sum(t.nbytes for t in [*m.parameters(), *m.buffers()])
    # relu's output is also saved by maxpool: counted once, at relu, and marked
    assert prof["relu"].shared and not prof["conv1"].shared
    # checkpointing layer1 frees less than it saves: its output stays saved by layer2 and its
    # input is kept by the checkpoint
    with hs.apply_checkpointing(m, ["layer1"]):
        after = reference_saved(m, _step(m, x))
    drop = prof.total_saved_bytes - after
    block_out = 2 * 64 * 8 * 8 * 4
    assert drop == prof["layer1"].saved_bytes_total - 2 * block_out
    plan = prof.plan(prof.total_saved_bytes - drop)
    assert plan.predicted_drop >= drop * 0.95


@pytest.mark.parametrize("fraction", [0.5])
def test_plan_predicted_drop_matches_measured_resnet18(fraction):
    m = _resnet18()
    x = torch.randn(2, 3, 32, 32)
    prof = hs.memory_profile(m, x)
    budget = int(prof.total_saved_bytes * fraction)
    plan = prof.plan(budget)
    assert plan.modules and plan.predicted_saved_bytes <= budget
    torch.manual_seed(1)
    ref = copy.deepcopy(m)
    out_ref = ref(x)
    out_ref.sum().backward()
    with hs.apply_checkpointing(m, plan) as handle:
        measured = prof.total_saved_bytes - reference_saved(m, _step(m, x))
        m.zero_grad()
        out = m(x)
        out.sum().backward()
    assert not handle.active and "forward" not in m.layer1.__dict__
    assert abs(plan.predicted_drop - measured) <= 0.05 * measured
    torch.testing.assert_close(out, out_ref)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_plan_accounts_for_shared_output():
    net = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Tanh()), nn.Linear(16, 1)
    )
    x = torch.randn(4, 8)
    prof = hs.memory_profile(net, x)
    act = 4 * 16 * 4  # one (4, 16) float activation
    # hand count: Linear 0 saves x (4*8 floats); each Tanh saves its output; Linear 2 saves its
    # input, the last Tanh's output (the same storage, counted once, marked at the Tanh)
    assert prof.total_saved_bytes == 4 * 8 * 4 + 3 * act
    assert prof["1"].saved_bytes_total == 3 * act and prof["1.2"].shared
    from hookscope.memory._plan import saved_after

    # checkpointing the whole Sequential frees two Tanh outputs, not three (the last stays saved
    # by Linear 2), and keeps its input (Linear 0's output, saved by nobody before): net one
    assert prof.total_saved_bytes - saved_after(prof, ["1"]) == act
    with hs.apply_checkpointing(net, ["1"]):
        assert prof.total_saved_bytes - reference_saved(net, _step(net, x)) == act
    # the last Tanh alone frees nothing; the middle one frees its output at a third the FLOPs
    assert prof.total_saved_bytes - saved_after(prof, ["1.2"]) == 0
    plan = prof.plan(prof.total_saved_bytes - 1)
    assert plan.modules == ["1.1"] and plan.predicted_drop == act
    with hs.apply_checkpointing(net, plan):
        assert prof.total_saved_bytes - reference_saved(net, _step(net, x)) == act
    with pytest.raises(hs.PlanError, match="lowest found"):
        prof.plan(4 * 8 * 4)


def test_vit_exact_and_plan():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=5,
    )
    assert torchvision
    x = torch.randn(2, 3, 32, 32)
    prof = check_exact(m, x)
    plan = prof.plan(int(prof.total_saved_bytes * 0.6))
    with hs.apply_checkpointing(m, plan):
        measured = prof.total_saved_bytes - reference_saved(m, _step(m, x))
    assert abs(plan.predicted_drop - measured) <= 0.05 * measured


def test_gpt2_block_stack_exact_and_plan():
    from helpers.lm import tiny_gpt2

    m = tiny_gpt2(n_layer=3, n_embd=32, n_head=2).train()
    ids = torch.randint(3, 40, (2, 12))

    def loss_fn(out):
        return out.logits.float().logsumexp(-1).mean()

    prof = check_exact(m, ids, loss_fn=loss_fn)
    assert prof["transformer.h.0"].saved_bytes_total > 0
    plan = prof.plan(int(prof.total_saved_bytes * 0.7))
    torch.manual_seed(3)
    m_ref = copy.deepcopy(m)
    with hs.apply_checkpointing(m, plan):
        measured = prof.total_saved_bytes - reference_saved(m, _step(m, ids, loss_fn=loss_fn))
    assert abs(plan.predicted_drop - measured) <= 0.05 * measured
    del m_ref


def test_autocast_bf16_exact():
    m = _resnet18()
    x = torch.randn(2, 3, 32, 32)
    ref = copy.deepcopy(m)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ref(x)
        out.float().sum().backward()

    expected = reference_saved(ref, run)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = hs.memory_profile(m, x)
    assert prof.total_saved_bytes == expected
    assert sum(r.saved_bytes for r in prof.rows) == expected
    # bf16: conv1 saves the bf16 copy of the image, half the fp32 bytes
    assert prof["conv1"].saved_bytes == 2 * 3 * 32 * 32 * 2 + 64 * 3 * 7 * 7 * 2


def test_compiled_model_per_region():
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = torch.compile(net, backend="aot_eager")
    x = torch.randn(4, 8)
    expected = reference_saved(net, _step(compiled, x))
    prof = hs.memory_profile(compiled, x)
    assert prof.per_region
    assert prof.total_saved_bytes == expected
    assert prof[""].saved_bytes == expected
    assert "per compiled region" in prof.to_text()
    with pytest.raises(hs.PlanError, match="before compiling"):
        prof.plan(0)
    # a compiled block inside an eager model: the block is one row, its children get nothing
    net2 = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)
    )
    net2[1].compile(backend="aot_eager")
    with warnings.catch_warnings():  # torch-internal: Dynamo reads .grad of a non-leaf it resumes
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not")
        expected = reference_saved(net2, _step(net2, x))
    prof = hs.memory_profile(net2, x)
    assert prof.per_region and prof.total_saved_bytes == expected
    assert prof["0"].saved_bytes == 4 * 8 * 4  # eager Linear: the input
    assert (
        prof["1"].saved_bytes == expected - 4 * 8 * 4 and prof["1.1"].calls is None
    )  # ran in the graph: not measured


def test_table_and_errors():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    prof = hs.memory_profile(net, torch.randn(2, 4))
    text = str(prof)
    assert "saved (total)" in text and "96 B" in text
    with pytest.raises(hs.LayerNotFoundError, match="'1'"):
        prof["l1"]
    with pytest.raises(hs.HookscopeError, match="does not require grad"):
        hs.memory_profile(net, torch.randn(2, 4), loss_fn=lambda out: out.detach().sum())
    with pytest.raises(hs.LayerNotFoundError, match="closest"):
        hs.apply_checkpointing(net, ["3"])
    with pytest.raises(ValueError, match="policy"):
        hs.apply_checkpointing(net, ["1"], kind="selective")


def test_backward_peak_and_live_bytes_by_hand():
    # Linear(4, 8) -> Tanh on (2, 4): the Linear output (64 B) and the Tanh output (64 B) are
    # alive at once (the forward peak); the Linear output is then dropped (Tanh saves its output,
    # Linear its input, which was there before), so at the loss (4 B) 68 B are alive
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    prof = hs.memory_profile(net, torch.randn(2, 4), backward_peak=True)
    assert prof.peak_forward_bytes == 64 + 64
    assert prof.live_bytes_end_forward == 64 + 4
    # backward adds Tanh's input gradient (64 B) and the weight and bias gradients (128 + 32 B)
    # to what forward left alive: 68 + 64 + 160 at most, and the two .grad stay
    assert 128 + 32 <= prof.peak_backward_bytes <= 68 + 64 + 128 + 32
    assert hs.memory_profile(net, torch.randn(2, 4)).peak_backward_bytes is None


def test_plot_and_rich():
    rich = pytest.importorskip("rich")
    pytest.importorskip("matplotlib")
    import io

    from rich.console import Console

    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 1)))
    prof = hs.memory_profile(net, torch.randn(2, 4))
    fig = prof.plot(depth=1)
    bars = fig.axes[0].patches
    assert sorted(round(b.get_width() * (1 << 20)) for b in bars) == sorted(
        r.saved_bytes_total for r in prof.rows if r.depth == 1 and r.saved_bytes_total
    )
    buf = io.StringIO()
    Console(file=buf, width=120).print(prof)
    assert "saved (total)" in buf.getvalue() and rich


def test_cli_summary_train(capsys):
    from hookscope.cli._main import main
    from hookscope.demo import DemoNet

    assert main(["summary", "demo", "--train", "--depth", "1", "--budget", "1MB"]) == 0
    out = capsys.readouterr().out
    torch.manual_seed(0)
    net = hs.load_demo_model().train()
    x = torch.randn(tuple(DemoNet.default_input_shape), generator=torch.Generator().manual_seed(0))
    prof = hs.memory_profile(net, x)
    assert f"({prof.total_saved_bytes:,} bytes" in out
    plan = prof.plan(1_000_000)
    assert f"-> {plan.predicted_saved_bytes:,} bytes" in out
    assert main(["summary", "demo", "--budget", "1MB"]) == 2
    assert "--budget needs --train" in capsys.readouterr().err
    assert main(["summary", "demo", "--train", "--budget", "4 parsecs"]) == 2
    assert main(["summary", "demo", "--train", "--budget", "1B"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "lowest found" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peaks_match_allocator():
    m = _resnet18().cuda()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    hs.memory_profile(m, x)  # warm up (cuDNN workspaces, allocator)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prof = hs.memory_profile(m, x, backward_peak=True)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    assert abs(max(prof.peak_forward_bytes, prof.peak_backward_bytes) - real) <= 0.10 * real


@pytest.mark.slow
def test_tutorial_runs_and_its_plan_holds(capsys):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "tutorial_memory.py"
    ns = runpy.run_path(str(path))
    plan, prof, after = ns["plan"], ns["prof"], ns["after"]
    assert prof.total_saved_bytes - after.total_saved_bytes == plan.predicted_drop
    assert after.total_saved_bytes <= plan.budget_bytes
    assert ns["same_grads"] and {n: len(c) for n, c in ns["cap"]._rec.calls.items()} == {
        "layer2.0.conv1": 1,
        "layer3": 1,
    }
    assert "measured drop" in capsys.readouterr().out


def test_exception_in_model_leaves_nothing_behind():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = nn.Sequential(nn.Linear(4, 4), Boom())
    g = torch.ones(4, 4)
    net[0].weight.grad = g
    with pytest.raises(RuntimeError, match="boom"):
        hs.memory_profile(net, torch.randn(2, 4))
    # no saved-tensor hooks, dispatch mode or module hook left; the grad put back
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    assert hs.hooks_on(net) == [] and net[0].weight.grad is g


def test_flops_equal_torch_flop_counter_on_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    class Attn(nn.Module):
        def forward(self, q, k):
            return torch.baddbmm(torch.zeros(3, 5, 5), q, k.transpose(1, 2)).bmm(q)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.proj = nn.Linear(6, 6, bias=False)
            self.attn = Attn()

        def forward(self, x):
            h = self.fc(x)
            return self.attn(h, self.proj(h))

    net, x = Net(), torch.randn(3, 5, 6)
    with FlopCounterMode(display=False) as counter:
        net(x)
    ref = {
        k.split(".", 1)[1]: sum(v.values())
        for k, v in counter.get_flop_counts().items()
        if "." in k
    }
    prof = hs.memory_profile(net, x)
    # matmuls counted as torch counts them (2 per multiply-add); the transpose view counts nothing
    # and the zeros tensor one per element (an op without a FLOP rule)
    assert prof["fc"].flops == ref["fc"] and prof["proj"].flops == ref["proj"]
    assert prof["attn"].flops == ref["attn"] + 3 * 5 * 5


class _Residual(nn.Module):
    def __init__(self, d: int, hidden: int, act: nn.Module) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), act, nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def _antichains(names):
    """Every set of module names none of which contains another."""
    import itertools

    def nested(a, b):
        return a.startswith(b + ".") or b.startswith(a + ".")

    for k in range(len(names) + 1):
        for combo in itertools.combinations(names, k):
            if not any(nested(a, b) for a, b in itertools.combinations(combo, 2)):
                yield combo


def test_plan_is_the_least_flops_plan_by_brute_force():
    from hookscope.memory._frontier import frontier
    from hookscope.memory._plan import saved_after

    torch.manual_seed(0)
    # 15 modules of unlike sizes (the old greedy planner paid more FLOPs at 6 of the 14 budgets
    # where the least-FLOPs plan changes)
    net = nn.Sequential(
        nn.Linear(6, 16),
        _Residual(16, 48, nn.GELU()),
        nn.LayerNorm(16),
        _Residual(16, 12, nn.Tanh()),
        nn.Sequential(nn.Sigmoid(), nn.Linear(16, 24), nn.GELU()),
        nn.Linear(24, 4),
    )
    x = torch.randn(5, 6)
    prof = hs.memory_profile(net, x)
    names = [r.name for r in prof.rows if r.name]
    flops = {r.name: r.flops_total for r in prof.rows}
    # every plan: (recompute FLOPs, modules, saved bytes), from saved_after of the whole set
    every = [
        (sum(flops[n] for n in s), len(s), saved_after(prof, s), s) for s in _antichains(names)
    ]
    assert len(every) > 1000
    # the frontier is exactly the brute-force Pareto set of (cost, saved bytes)
    every.sort(key=lambda p: (p[0], p[1], p[2]))
    pareto = []
    for p in every:
        if not pareto or p[2] < pareto[-1][2]:
            pareto.append(p)
    base, front = frontier(prof)
    assert front.exact and len(front.plans) == len(pareto) > 10
    assert [(f, k, base + b) for f, k, b, _ in front.plans] == [p[:3] for p in pareto]
    for _f, _k, b, chosen in front.plans:
        assert saved_after(prof, chosen) == base + b
    # every budget between the least and the total: the plan is the cheapest that fits
    budgets = sorted({p[2] for p in every} | {p[2] - 1 for p in every})
    for budget in budgets:
        fits = [p for p in every if p[2] <= budget]
        if not fits:
            with pytest.raises(hs.PlanError, match=f"lowest found is {pareto[-1][2]:,}"):
                prof.plan(budget)
            continue
        plan = prof.plan(budget)
        best = min(fits, key=lambda p: (p[0], p[1]))
        assert (plan.recompute_flops, len(plan.modules)) == best[:2], budget
        assert plan.predicted_saved_bytes <= budget and plan.exact
    # and what it predicts is what happens: measured on a few of them
    for budget in budgets[:: max(1, len(budgets) // 6)]:
        if budget < pareto[-1][2]:
            continue
        plan = prof.plan(budget)
        with hs.apply_checkpointing(net, plan):
            assert reference_saved(net, _step(net, x)) == plan.predicted_saved_bytes


def test_live_bytes_leave_out_the_given_input_and_in_place_results():
    # Flatten is a view of the given input (there before the step: not counted); Linear makes the
    # one new activation (2 x 8 floats, 64 B); the in-place ReLU writes it (no new storage); the
    # loss is 4 B. Counting the view as a new storage would add the input's 32 B.
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(inplace=True))
    prof = hs.memory_profile(net, torch.randn(2, 2, 2))
    assert prof.peak_forward_bytes == prof.live_bytes_end_forward == 64 + 4
    assert prof["2"].flops == 2 * 8  # one per element for the in-place ReLU, as before


def test_a_profile_leaves_python_state_as_found_and_a_library_s_own_marks_in_place():
    """A layer's call counter, list and tensor attribute are put back; Transformers' mark that it
    installed its output-capturing hooks (set on the first forward asking for hidden states) is
    kept: removing it made the next forward install them again, and every later
    ``output_hidden_states=True`` forward returned each hidden state twice (5 instead of 3)."""
    transformers = pytest.importorskip("transformers")
    from helpers.common import Counting

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), Counting(3))
    hs.memory_profile(net, torch.randn(2, 3))
    assert net[1].state() == (False, 0, [], 0.0)

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    lm = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 6))
    hs.memory_profile(
        lm, ids, output_hidden_states=True, loss_fn=lambda o: o.logits.float().pow(2).mean()
    )
    out = lm(ids, output_hidden_states=True)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
