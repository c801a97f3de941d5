"""hs.record on 2 gloo ranks (DDP, each rank its share of the batch), compared with one process
running the same weights on the combined batch: the ranks' values joined along the batch."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from helpers.common import tiny_models_on_one_thread  # noqa: F401  (autouse fixture)
from helpers.dist import WORLD, launch

SHARE = 3  # per rank; the combined batch is WORLD * SHARE


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(inplace=True),  # an in-place module, as real models have
        nn.Conv2d(4, 4, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def batch() -> torch.Tensor:
    return torch.randn(WORLD * SHARE, 2, 6, 6, generator=torch.Generator().manual_seed(1))


def mean_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _record_ddp(rank: int, folder: str, make: object, data=None, sync: bool = True) -> None:
    """The record of one DDP rank: ``make()``'s model on its share of ``data()`` (``batch``);
    ``sync=False``: the backward under ``no_sync()`` (gradients not reduced)."""
    import contextlib

    ddp = nn.parallel.DistributedDataParallel(make())  # type: ignore[operator]
    x = (data or batch)()[rank * SHARE : (rank + 1) * SHARE]
    with contextlib.nullcontext() if sync else ddp.no_sync(), hs.record(ddp, folder):
        mean_loss(ddp(x)).backward()


def _record_all(rank: int, root: str) -> None:
    """Every record of this file, in one launch of the ranks (each launch costs seconds)."""
    _record_ddp(rank, f"{root}/cnn", make_cnn)
    _record_sum(rank, f"{root}/sum")
    _record_ddp(rank, f"{root}/uneven", Uneven, uneven_batch)
    for train in (False, True):
        _record_bn(rank, f"{root}/bn-{train}", train)
    _record_fsdp2(rank, f"{root}/fsdp2")
    _record_fsdp2(rank, f"{root}/fsdp2-wd", decay=True)
    _record_fsdp2(rank, f"{root}/fsdp2-wd-kept", decay=True, reshard=False)
    _record_ddp(rank, f"{root}/pos", PosNet, pos_batch)
    _record_ddp(rank, f"{root}/nosync", make_cnn, sync=False)
    for k in (1, 2):  # two forward-only records of the same model on the same data
        _record_forward(rank, f"{root}/fwd{k}")
    _record_seq_first(rank, f"{root}/seqfirst")
    _record_ddp(rank, f"{root}/mask", MaskNet, mask_batch)


def make_seq_first() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def seq_first_batch() -> torch.Tensor:
    """(T, B, D) = (5, WORLD * SHARE, 4): the batch on dimension 1, as nn.LSTM's default."""
    return torch.randn(5, WORLD * SHARE, 4, generator=torch.Generator().manual_seed(3))


def _record_seq_first(rank: int, folder: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(make_seq_first())
    with hs.record(ddp, folder):
        mean_loss(ddp(seq_first_batch()[:, rank * SHARE : (rank + 1) * SHARE])).backward()


def _record_forward(rank: int, folder: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(make_cnn())
    with torch.no_grad(), hs.record(ddp, folder):
        ddp(batch()[rank * SHARE : (rank + 1) * SHARE])
    # a forward without backward has no collective: without this, rank 0 can finish the last
    # record and end the process group (its store) before rank 1 starts it, which then has no
    # run id (a run carries on with collectives; its last step ends with the group)
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    launch(_record_all, str(root))
    return root


@pytest.fixture
def cnn_record(records):
    return str(records / "cnn")


def _worst(report, attr):
    vals = [getattr(r, attr) for r in report.rows if getattr(r, attr) is not None]
    assert vals, attr
    return max(vals)


@pytest.mark.distributed
def test_each_rank_writes_its_own_record_with_eager_names(cnn_record):
    import json
    import pathlib

    for rank in range(WORLD):
        index = json.loads((pathlib.Path(cnn_record) / f"rank{rank}" / "index.json").read_text())
        assert (index["rank"], index["world"]) == (rank, WORLD)
        names = [c["name"] for c in index["calls"]]
        assert names[:3] == ["", "0", "1"]  # the wrapped model's names, no "module." prefix


@pytest.mark.distributed
def test_a_folder_holding_the_ranks_records_takes_no_other_record(cnn_record):
    model = make_cnn()
    with (
        pytest.raises(hs.CompareError, match="already holds a record"),
        hs.record(model, cnn_record),
    ):
        model(batch())


def test_a_rank_of_a_run_of_more_ranks_is_refused_where_fewer_ranks_recorded(
    cnn_record, monkeypatch
):
    """Rank 2 of a 4-rank run into the folder of a 2-rank record: its own folder (rank2) is
    free, yet it would leave a mixed record; refused by name, nothing written."""
    import importlib

    rec = importlib.import_module("hookscope.compare._record")
    monkeypatch.setattr(rec, "_rank_world", lambda: (WORLD, 2 * WORLD))
    model = make_cnn()
    with (
        pytest.raises(hs.CompareError, match=f"record of {WORLD} ranks"),
        hs.record(model, cnn_record),
    ):
        model(batch())
    from pathlib import Path

    assert not (Path(cnn_record) / f"rank{WORLD}").exists()


@pytest.mark.distributed
def test_ddp_ranks_match_one_process_on_the_combined_batch(cnn_record):
    report = hs.compare(cnn_record, make_cnn(), batch(), loss_fn=mean_loss)
    assert report.culprit is None and report.first_divergent is None
    assert report.unmatched == []
    assert report.notes[0] == "a: the records of 2 ranks, joined into one run on the combined batch"
    assert all("no gradient recorded" in n for n in report.notes[1:])  # in-place ReLUs
    assert len(report.rows) == 7
    # fp32 round-off only: the joined outputs, the rescaled activation gradients and DDP's
    # averaged parameter gradients against the combined run's
    assert _worst(report, "error") < 1e-6
    assert _worst(report, "grad_error") < 1e-6
    assert _worst(report, "param_grad_error") < 1e-6
    assert _worst(report, "local_error") < 1e-6


@pytest.mark.distributed
def test_a_fault_only_in_the_live_model_is_named(cnn_record):
    b = make_cnn()
    with torch.no_grad():
        b[2].bias += 0.05  # one module's own computation changed
    report = hs.compare(cnn_record, b, batch(), loss_fn=mean_loss)
    assert report.culprit == "2"
    assert report.first_divergent == "2"


@pytest.mark.distributed
def test_a_backward_only_fault_is_named(cnn_record):
    class NoDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.tanh()

        @staticmethod
        def backward(ctx, g):  # wrong: ignores tanh's derivative
            return g

    class BadTanh(nn.Module):
        def forward(self, x):
            return NoDerivative.apply(x)

    b = make_cnn()
    b[3] = BadTanh()
    report = hs.compare(cnn_record, b, batch(), loss_fn=mean_loss)
    assert report.culprit == "3"
    assert report.row("3").flagged == "backward"


@pytest.mark.distributed
def test_the_wrong_loss_reduction_is_refused_by_name(cnn_record):
    with pytest.raises(hs.CompareError, match="loss_reduction='mean'"):
        hs.compare(cnn_record, make_cnn(), batch(), loss_fn=mean_loss, loss_reduction="sum")
    with pytest.raises(hs.CompareError, match="'mean', 'sum'"):
        hs.compare(cnn_record, make_cnn(), batch(), loss_fn=mean_loss, loss_reduction="avg")


@pytest.mark.distributed
def test_a_sum_loss_compares_with_loss_reduction_sum(records):
    folder = str(records / "sum")
    b = make_cnn()
    report = hs.compare(folder, b, batch(), loss_fn=sum_loss, loss_reduction="sum")
    assert report.culprit is None
    assert _worst(report, "grad_error") < 1e-6
    assert _worst(report, "param_grad_error") < 1e-6
    with pytest.raises(hs.CompareError, match="loss_reduction='sum'"):
        hs.compare(folder, b, batch(), loss_fn=sum_loss)


def sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _record_sum(rank: int, folder: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(make_cnn())
    x = batch()[rank * SHARE : (rank + 1) * SHARE]
    with hs.record(ddp.module, folder):  # the wrapped model: the same record
        sum_loss(ddp(x)).backward()


@pytest.mark.distributed
def test_two_rank_records_compare_with_each_other_and_with_a_one_process_record(
    cnn_record, tmp_path
):
    model = make_cnn()
    with hs.record(model, tmp_path):
        mean_loss(model(batch())).backward()
    report = hs.compare(cnn_record, str(tmp_path))
    assert report.first_divergent is None and report.unmatched == []
    assert _worst(report, "error") < 1e-6 and _worst(report, "grad_error") < 1e-6
    with pytest.warns(hs.HookscopeWarning, match="the same record"):
        same = hs.compare(cnn_record, cnn_record)
    assert _worst(same, "error") == 0.0 and _worst(same, "grad_error") == 0.0


class Uneven(nn.Module):
    """``extra`` runs on a rank only when its share's sum is positive; ``stat`` returns a
    per-feature statistic of the share (neither batch-shaped nor equal across ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)
        self.extra = nn.Tanh()
        self.stat = Stat()

    def forward(self, x):
        y = self.lin(x)
        if x[:, 0].sum() > 0:
            y = self.extra(y)
        return y + self.stat(y)


class Stat(nn.Module):
    def forward(self, y):
        return y.mean(dim=0)


def uneven_batch() -> torch.Tensor:
    x = torch.randn(WORLD * SHARE, 5, generator=torch.Generator().manual_seed(2))
    x[:SHARE, 0] = x[:SHARE, 0].abs()  # rank 0: extra runs
    x[SHARE:, 0] = -x[SHARE:, 0].abs()  # rank 1: it does not
    return x


@pytest.mark.distributed
def test_calls_that_differ_across_ranks_are_listed_never_paired(records):
    folder = str(records / "uneven")
    report = hs.compare(folder, Uneven(), uneven_batch(), loss_fn=mean_loss)
    assert [r.label for r in report.rows if r.name == "extra"] == []
    assert any(u.startswith("a: extra#0 (ran 1/0 times") for u in report.unmatched)
    stat = report.row("stat")
    assert stat.error is None and stat.flagged is None
    assert stat.note.startswith("ranks cannot be joined: output leaf 0")
    lin = report.row("lin")  # before any rank-dependent step: joined exactly
    assert lin.error is not None and lin.error < 1e-6
    # the root's replay would stand in rank 0's value for stat's: no local error, no verdict
    root = report.row("")
    assert root.local_error is None and root.flagged is None and "stat#0" in root.note
    assert report.culprit is None and report.first_divergent == "<root>"


def _record_fsdp2(rank: int, folder: str, decay: bool = False, reshard: bool = True) -> None:
    """``decay``: the loss also holds a term on the weights, outside the model's call: each
    gathered whole from its shards (``p.full_tensor()``), or, with ``reshard=False`` (FSDP2
    keeps the unsharded parameters from the forward to the backward), the unsharded one the
    model holds then."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_cnn()
    for sub in (model[0], model[2], model[5]):
        fully_shard(sub, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x = batch()[rank * SHARE : (rank + 1) * SHARE]
    # the record hands each output on as an identity view (gradients are then what the callers
    # send back); FSDP2 warns that an in-place op on a view a sharded module returns would skip
    # its hooks (the guide says so)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FSDP2-wrapped module")
        with hs.record(model, folder):
            loss = mean_loss(model(x))
            if decay:
                weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
                whole = [getattr(p, "full_tensor", lambda p=p: p)() for p in weights]
                loss = loss + 1e-2 * sum(w.pow(2).sum() for w in whole)
            loss.backward()


@pytest.mark.distributed
@pytest.mark.parametrize("kept", [False, True])
def test_fsdp2_weights_gathered_whole_in_the_loss_are_noted_as_used_outside(records, kept):
    """FSDP2's parameters are sharded: a term on the weights in the loss reads each one whole
    through ``p.full_tensor()`` (or, where FSDP2 keeps them unsharded until the backward, the
    unsharded one the model holds then). The records note those parameters as used outside the
    model's call, and the comparison leaves their gradients out (they hold the term's share),
    saying so; the rest compares as one process on the combined batch, and a fault is still
    named."""
    folder = records / ("fsdp2-wd-kept" if kept else "fsdp2-wd")
    weights = sorted(n for n, _ in make_cnn().named_parameters() if n.endswith("weight"))
    for rank in range(WORLD):
        index = json.loads((folder / f"rank{rank}" / "index.json").read_text())
        assert index["outside"] == weights
    report = hs.compare(str(folder), make_cnn(), batch(), loss_fn=mean_loss)
    assert report.culprit is None
    assert _worst(report, "grad_error") < 1e-6
    assert "not compared" in report.row("5").note
    b = make_cnn()
    with torch.no_grad():
        b[5].weight[0] *= 1.01
    assert hs.compare(str(folder), b, batch(), loss_fn=mean_loss).culprit == "5"


@pytest.mark.distributed
def test_fsdp2_ranks_match_one_process_and_a_fault_is_named(records):
    folder = str(records / "fsdp2")
    for rank in range(WORLD):  # (FSDP2 sets the gradients itself: no use outside is seen)
        assert (
            json.loads((records / "fsdp2" / f"rank{rank}" / "index.json").read_text())["outside"]
            == []
        )
    report = hs.compare(folder, make_cnn(), batch(), loss_fn=mean_loss)
    assert report.culprit is None and report.unmatched == []
    assert _worst(report, "error") < 1e-6
    assert _worst(report, "grad_error") < 1e-6
    # the sharded parameter gradients, gathered whole, are the combined run's
    assert _worst(report, "param_grad_error") < 1e-6
    b = make_cnn()
    with torch.no_grad():
        b[5].weight[0] *= 1.01
    assert hs.compare(folder, b, batch(), loss_fn=mean_loss).culprit == "5"


def make_bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)
    )


def _record_bn(rank: int, folder: str, train: bool) -> None:
    ddp = nn.parallel.DistributedDataParallel(make_bn_cnn().train(train))
    x = batch()[rank * SHARE : (rank + 1) * SHARE]
    with hs.record(ddp, folder):
        mean_loss(ddp(x)).backward()


@pytest.mark.distributed
@pytest.mark.parametrize("train", [False, True])
def test_batchnorm_in_training_mode_is_named_for_its_per_rank_statistics(records, train):
    """Each rank normalises by its own share's statistics (plain BatchNorm under DDP): that is a
    different computation from one process on the combined batch, and BatchNorm is named; in
    eval mode (running statistics) the runs agree."""
    folder = str(records / f"bn-{train}")
    report = hs.compare(folder, make_bn_cnn().train(train), batch(), loss_fn=mean_loss)
    assert report.culprit == ("1" if train else None)
    assert report.row("0").error == 0.0
    # said in its row and in the report: a difference by construction, and the fix
    said = "each rank normalised its share"
    assert (said in (report.row("1").note or "")) == train
    assert any("SyncBatchNorm" in n for n in report.notes) == train


CNN_FILE = """
import torch, torch.nn as nn

class CNN(nn.Sequential):
    def __init__(self, bias=0.0):
        torch.manual_seed(0)
        super().__init__(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Tanh(),
            nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
        )
        with torch.no_grad():
            self[2].bias += bias
"""


@pytest.mark.distributed
def test_the_cli_reads_the_ranks_record_on_the_combined_inputs(cnn_record, tmp_path, capsys):
    import json

    from hookscope.cli import main

    (tmp_path / "cnn.py").write_text(CNN_FILE)
    spec = f"{tmp_path / 'cnn.py'}:CNN"
    # --loss square is mean_loss: out.pow(2).mean()
    assert main(["compare", cnn_record, spec, "--loss", "square", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit"] is None
    assert main(["compare", cnn_record, spec + "(bias=0.05)", "--loss", "square", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit"] == "2"
    args = ["compare", cnn_record, spec, "--loss", "square", "--loss-reduction", "sum"]
    assert main(args) == 2
    assert "loss_reduction='mean'" in capsys.readouterr().err


def _mixed(records, tmp_path, rank1_from: str, rank1_as: str = "rank1") -> str:
    import shutil

    folder = tmp_path / "mixed"
    shutil.copytree(records / "cnn" / "rank0", folder / "rank0")
    shutil.copytree(records / rank1_from, folder / rank1_as)
    return str(folder)


@pytest.mark.distributed
def test_rank_folders_of_two_runs_are_refused_not_joined(records, tmp_path):
    """Rank 1 of another run (the same model, another loss) beside rank 0: joined, it named a
    fault-free live model's layer; DDP leaves every rank the same parameter gradients, so the
    mix is refused naming the parameter. Rank 0's folder copied as rank 1's (its index says rank
    0) is refused too."""
    mixed = _mixed(records, tmp_path, "sum/rank1")
    with pytest.raises(hs.CompareError, match="come from different runs"):
        hs.compare(mixed, make_cnn(), batch(), loss_fn=mean_loss)
    # records without a run id (made before it was kept): the gradients still tell
    for rank in ("rank0", "rank1"):
        _without_run_id(tmp_path / "mixed" / rank / "index.json")
    with pytest.raises(hs.CompareError, match="cannot be one run.*the gradient of .0.weight."):
        hs.compare(mixed, make_cnn(), batch(), loss_fn=mean_loss)
    twice = _mixed(records, tmp_path / "twice", "cnn/rank0")
    with pytest.raises(hs.CompareError, match="rank1 holds rank 0 of 2"):
        hs.compare(twice, make_cnn(), batch(), loss_fn=mean_loss)


def _without_run_id(path) -> None:
    """The index as a record made before run ids were kept (its own checksum made again)."""
    import importlib

    _record = importlib.import_module("hookscope.compare._record")
    index = json.loads(path.read_text())
    del index["run"]
    index["checksums"]["index.json"] = _record._index_crc(index)
    path.write_text(json.dumps(index))


@pytest.mark.distributed
def test_forward_only_rank_records_of_two_runs_are_refused_by_their_run_ids(records, tmp_path):
    """Two forward-only records of one model on the same data: no gradients to tell them apart,
    so a folder holding rank 0 of one and rank 1 of the other joined into one run silently. Each
    record keeps an id its ranks share (set in the process group's store by the first rank to
    start it): the mix is refused, each record alone compares."""
    import shutil

    for k in (1, 2):
        assert hs.compare(str(records / f"fwd{k}"), make_cnn(), batch()).culprit is None
    runs = {
        json.loads((records / f"fwd{k}" / f"rank{r}" / "index.json").read_text())["run"]
        for k in (1, 2)
        for r in range(WORLD)
    }
    assert len(runs) == 2  # one id per record, shared by its ranks
    shutil.copytree(records / "fwd1" / "rank0", tmp_path / "mix" / "rank0")
    shutil.copytree(records / "fwd2" / "rank1", tmp_path / "mix" / "rank1")
    with pytest.raises(hs.CompareError, match=r"come from different runs \(rank0's and rank1's"):
        hs.compare(str(tmp_path / "mix"), make_cnn(), batch())


@pytest.mark.distributed
def test_a_folder_holding_a_one_process_record_and_rank_records_is_refused(records, tmp_path):
    """Both kinds in one folder (two runs recorded into it at once): compare used to read the
    one-process record and ignore the ranks'; refused. A record of one process into a folder
    where a rank is being written (its values.bin, no index yet) is refused when it starts, and
    a rank's record where one process is being written; each removes its own file."""
    import shutil

    folder = tmp_path / "both"
    shutil.copytree(records / "cnn", folder)
    model = make_cnn()
    with hs.record(model, tmp_path / "one"):
        mean_loss(model(batch())).backward()
    model.zero_grad(set_to_none=True)
    for name in ("index.json", "values.bin", "params.pt"):
        shutil.copy(tmp_path / "one" / name, folder / name)
    with pytest.raises(hs.CompareError, match="both a record of one process"):
        hs.compare(str(folder), make_cnn(), batch(), loss_fn=mean_loss)

    writing = tmp_path / "writing"
    (writing / "rank1").mkdir(parents=True)
    shutil.copy(records / "cnn" / "rank1" / "values.bin", writing / "rank1" / "values.bin")
    with (
        pytest.raises(hs.CompareError, match="already holds records of ranks"),
        hs.record(model, writing),
    ):
        model(batch())
    assert not (writing / "values.bin").exists()


def test_a_rank_record_where_one_process_is_recording_is_refused(tmp_path, monkeypatch):
    import importlib

    rec = importlib.import_module("hookscope.compare._record")
    monkeypatch.setattr(rec, "_rank_world", lambda: (1, WORLD))
    (tmp_path / "values.bin").write_bytes(b"")  # one process's record, being written
    model = make_cnn()
    with (
        pytest.raises(hs.CompareError, match="already holds a record of one process"),
        hs.record(model, tmp_path),
    ):
        model(batch())
    assert not (tmp_path / "rank1" / "values.bin").exists()


@pytest.mark.distributed
def test_a_rank_record_without_rank0_names_the_missing_rank(records, tmp_path):
    import shutil

    shutil.copytree(records / "cnn" / "rank1", tmp_path / "rank1")
    with pytest.raises(hs.CompareError, match=r"holds no record of rank\(s\) \[0\]"):
        hs.compare(str(tmp_path), make_cnn(), batch(), loss_fn=mean_loss)


@pytest.mark.distributed
def test_a_rank_record_of_another_loss_is_named_as_such_not_as_a_reduction(records):
    """A sum loss recorded on the ranks against a live mean loss: the gradients differ by a factor
    neither reduction explains; the message said to pass the reduction already given."""
    folder = str(records / "sum")
    for red in ("mean", "sum"):
        with pytest.raises(hs.CompareError, match="losses differ") as info:
            hs.compare(folder, make_cnn(), batch(), loss_fn=mean_loss, loss_reduction=red)
        assert f"pass loss_reduction={red!r}" not in str(info.value)


class PosNet(nn.Module):
    """A learned position embedding: its output (1, T, 4) is the same on every rank, and every
    rank's share of the batch uses it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Embedding(6, 4)
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(x.shape[1])[None])
        return self.lin(x + p)


def pos_batch() -> torch.Tensor:
    return torch.randn(WORLD * SHARE, 6, 4, generator=torch.Generator().manual_seed(2))


@pytest.mark.distributed
def test_the_gradient_of_a_value_every_rank_shares_is_the_sum_of_the_ranks_own(records):
    """A position embedding's output is equal on every rank; its gradient (every share used it)
    was left unjoined ("ranks cannot be joined"), and the parent's row lost its local error. It
    is the sum of the ranks' rescaled gradients: equal to one process's on the combined batch."""
    report = hs.compare(str(records / "pos"), PosNet(), pos_batch(), loss_fn=mean_loss)
    assert report.culprit is None and report.first_divergent is None
    pos = report.row("pos")
    assert not pos.note
    assert pos.grad_error is not None and pos.grad_error < 1e-6
    assert report.row("").local_error is not None
    with torch.no_grad():
        faulty = PosNet()
        faulty.pos.weight[2] += 0.1
    assert hs.compare(str(records / "pos"), faulty, pos_batch(), loss_fn=mean_loss).culprit == "pos"


@pytest.mark.distributed
def test_a_record_whose_backward_did_not_sync_is_refused_naming_no_sync(records):
    """Recorded under DDP's no_sync(): each rank holds its own share's gradients, which joined
    as DDP's averaged ones named a false culprit; refused, naming no_sync as a cause."""
    with pytest.raises(hs.CompareError, match=r"no_sync\(\)"):
        hs.compare(str(records / "nosync"), make_cnn(), batch(), loss_fn=mean_loss)


@pytest.mark.distributed
def test_a_sequence_first_record_of_ranks_is_refused_naming_the_batch_dimension(records):
    """Ranks are joined along each tensor's first dimension (the rank's batch share): a record
    whose inputs are sequence-first, (T, B, D) with each rank its share of B, joins as
    (2T, B/2, D), and comparing it with one process on the combined batch was refused as if the
    inputs given differed from the record's, with no word of why; now the refusal says how the
    ranks were joined and the fix."""
    with pytest.raises(hs.CompareError, match=r"\(10, 3, 4\) in the record.*batch_first=True"):
        hs.compare(
            str(records / "seqfirst"), make_seq_first(), seq_first_batch(), loss_fn=mean_loss
        )


class _Mix(nn.Module):
    """Attention over the tokens with an additive (T, T) mask: one value for the whole batch."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = h @ h.transpose(-1, -2) / 2 + mask
        return scores.softmax(-1) @ h


class MaskNet(nn.Module):
    """Values that are not split by batch but whose first dimension equals the rank's share
    (SHARE tokens): a position table's output (T, 4) and a causal mask (T, T), the same on every
    rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(SHARE, 4)
        self.mix = _Mix()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.full((t, t), -1e4).triu(1)
        h = x + self.table(torch.arange(t))
        return self.lin(self.mix(h, mask))


def mask_batch() -> torch.Tensor:
    return torch.randn(WORLD * SHARE, SHARE, 4, generator=torch.Generator().manual_seed(4))


@pytest.mark.distributed
def test_a_value_of_the_shares_length_but_not_split_by_batch_is_taken_once(records, tmp_path):
    """A (T, T) mask and a position table's (T, 4) output, equal on every rank, whose first
    dimension happens to equal the rank's batch share (T = SHARE) were concatenated as batch
    shares ((2T, T)): the replay of the module taking the mask failed and the table's output
    differed in shape from the combined run's, a false culprit. Such a leaf is now decided by
    the combined run's shape: taken once (its gradient the ranks' sum), as one process on the
    combined batch (B, live: the reference) computes it; against a one-process record too."""
    report = hs.compare(str(records / "mask"), MaskNet(), mask_batch(), loss_fn=mean_loss)
    assert report.culprit is None and report.first_divergent is None
    assert not [n for n in report.notes if "cannot be joined" in n]
    for name in ("table", "mix", "lin", ""):
        r = report.row(name)
        assert not r.note, (name, r.note)
        assert r.error is not None and r.error < 1e-6, name
        assert r.local_error is not None and r.local_error < 1e-6, name
        assert r.grad_error is not None and r.grad_error < 1e-6, name
    faulty = MaskNet()
    faulty.mix.forward = lambda h, mask: _Mix.forward(faulty.mix, h * 1.01, mask)
    got = hs.compare(str(records / "mask"), faulty, mask_batch(), loss_fn=mean_loss)
    assert got.culprit == "mix"
    single = MaskNet()
    with hs.record(single, tmp_path / "one"):
        mean_loss(single(mask_batch())).backward()
    both = hs.compare(str(records / "mask"), str(tmp_path / "one"))
    assert both.first_divergent is None
    assert all(r.error is not None and r.error < 1e-6 for r in both.rows)
