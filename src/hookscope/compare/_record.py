"""``hs.record``: write what ``hs.compare`` needs of a run to a folder, as the run goes.

Per module call, into the folder: its inputs when it starts (``in<k>.pt``, copied before the
module can change them in place), its output when it ends (``out<k>.pt``), and during backward the
gradient of each output leaf (what the callers send back: the output is handed on as identity
views, so a tensor the module also uses inside does not count that use) and of each input leaf
through this call only (``grad<k>_<i>.pt``, ``ingrad<k>_<i>.pt``). At exit: the parameter
gradients (``params.pt``) and ``index.json`` (the call tree, the order calls ended, dtypes).
Nothing of the run is held in memory beyond the inputs of the calls still running.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..core._compiled import named_modules, named_parameters, strip_compiled
from ..core._errors import enter_once
from ..core._nested import iter_tensors
from ..core._scope import HookScope, check_model, identity_views, in_backward
from ..core._select import resolve
from ._ranks import join_ranks
from ._run import CallRec, CompareError, RunRecord, _aliases, model_dtype
from ._store import ValueStore, cpu_copy

__all__ = ["Record", "load_record", "record"]

_VERSION = 1


class Record:
    """The context manager :func:`record` returns; after the block, ``calls`` is the number of
    module calls written and ``folder`` where."""

    def __init__(self, model: nn.Module, folder: Path, layers: Any) -> None:
        self.folder = folder
        self.calls = 0
        # DistributedDataParallel: hooks on the wrapped model, so names carry no "module." prefix
        model = getattr(model, "module", model) if _is_ddp(model) else model
        self.rank, self.world = _rank_world()
        self._dir = folder / f"rank{self.rank}" if self.world > 1 else folder
        self._model = model
        self._layers = layers
        self._scope = HookScope("record")
        self._tree: list[dict[str, Any]] = []
        self._stack: list[int] = []
        self._counts: dict[str, int] = {}
        self._ended = 0
        self._grads = False
        self._store = ValueStore(0, self._dir)  # everything goes to disk at once

    def __enter__(self) -> Record:
        enter_once(self, "record", self._scope.active)
        model = self._model
        check_model(model)
        named = dict(named_modules(model)) if self._layers is None else resolve(model, self._layers)
        self._dir.mkdir(parents=True, exist_ok=True)
        # one process: nor a record of several ranks (their folders) already in it
        taken = (self.folder, self._dir) if self.world > 1 else (self.folder, self.folder / "rank0")
        if any((d / "index.json").exists() for d in taken):
            raise CompareError(
                f"hs.record: {str(self.folder)!r} already holds a record; give an empty folder"
            )
        for name, m in named.items():
            self._scope.add_forward_pre(m, self._pre(name), layer=name, with_kwargs=True)
            self._scope.add_forward(m, self._post(name), layer=name, always_call=True)
        # the number of forward passes recorded (hs.compare compares one): counted on the model
        self._root, self._model_calls = strip_compiled(model), 0
        if not any(m is self._root for m in named.values()):
            self._scope.add_forward_pre(self._root, self._count, layer="")
        self._owners = {
            (f"{n}.{p}" if n else p): n
            for n, m in named_modules(model)
            for p, _ in m.named_parameters(recurse=False)
        }
        for p in model.parameters():
            if p.grad is not None:
                raise CompareError(
                    "hs.record: the model's parameters already hold gradients; call "
                    "model.zero_grad(set_to_none=True) first, so the record holds this run's"
                )
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._scope.remove()
        if exc is not None:
            return
        params = {n: _full(p.grad) for n, p in named_parameters(self._model)}
        torch.save(params, self._dir / "params.pt")
        index = {
            "version": _VERSION,
            "model": type(self._model).__name__,
            "dtype": str(model_dtype(self._model)).removeprefix("torch."),
            "autocast": None,
            "grads": self._grads or any(v is not None for v in params.values()),
            "params": self._owners,
            "calls": self._tree,
            "model_calls": self._model_calls,
            "rank": self.rank,
            "world": self.world,
        }
        tmp = self._dir / "index.json.tmp"
        tmp.write_text(json.dumps(index))
        os.replace(tmp, self._dir / "index.json")
        self.calls = len(self._tree)

    # -- hooks ---------------------------------------------------------------------------------
    def _grad_hook(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self._grads = True
            self._store.write(key, g.detach().cpu())

        return hook

    def _watch(self, value: Any, key: str, layer: str) -> None:
        seen: set[int] = set()
        for i, (_, t) in enumerate(iter_tensors(value)):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                self._scope.add_activation_grad_hook(t, self._grad_hook(f"{key}_{i}"), layer=layer)

    def _count(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self._model_calls += 1

    def _pre(self, name: str) -> Callable[..., Any]:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if in_backward():
                return None
            if module is self._root:
                self._model_calls += 1
            i = self._counts.get(name, 0)
            self._counts[name] = i + 1
            pos = len(self._tree)
            parent = self._stack[-1] if self._stack else None
            n_in = sum(1 for _ in iter_tensors((args, kwargs)))
            entry = {"name": name, "index": i, "parent": parent, "end": -1, "children": [],
                     "alias": _aliases((args, kwargs)), "n_in": n_in, "n_out": 0}  # fmt: skip
            self._tree.append(entry)
            if parent is not None:
                self._tree[parent]["children"].append(pos)
            self._stack.append(pos)
            self._store.write(f"in{pos}", cpu_copy((tuple(args), dict(kwargs))))
            if not torch.is_grad_enabled():
                return None
            if not any(t.requires_grad for _, t in iter_tensors((args, kwargs))):
                return None
            new_args, new_kwargs = identity_views(args, kwargs)
            self._watch((new_args, new_kwargs), f"ingrad{pos}", name)
            return new_args, new_kwargs

        return pre

    def _post(self, name: str) -> Callable[..., Any]:
        def post(module: nn.Module, args: Any, output: Any) -> Any:
            if in_backward() or not self._stack:
                return None
            pos = self._stack.pop()
            entry = self._tree[pos]
            entry["end"] = self._ended
            self._ended += 1
            entry["n_out"] = sum(1 for _ in iter_tensors(output))
            self._store.write(f"out{pos}", cpu_copy(output))
            if output is None or not torch.is_grad_enabled():
                return None
            views, _ = identity_views(output, {})
            self._watch(views, f"grad{pos}", name)
            return views

        return post


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _rank_world() -> tuple[int, int]:
    """This process's rank and the world size of an initialised ``torch.distributed`` run."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter gradient on the CPU, whole: a sharded one (FSDP2 ``DTensor``) is gathered
    (a collective: every rank calls this for the same parameters in the same order)."""
    if g is None:
        return None
    full = getattr(g, "full_tensor", None)
    return cpu_copy(full() if full is not None else g)


def record(model: nn.Module, folder: str | os.PathLike[str], layers: Any = None) -> Record:
    """Write what :func:`hookscope.compare` needs of one run to ``folder``, as the run goes.

    Use it around one forward (and backward) of the run to keep; compare it later, in another
    process or on another machine, with ``hs.compare(folder, live_model, *inputs, loss_fn=...)``
    (the same culprit semantics as two live models) or ``hs.compare(folder_a, folder_b)``
    (errors and ``first_divergent``; the culprit needs a live B). Each module call's inputs,
    output and gradients are written when they exist (nothing is kept in memory); the files are
    pickles (``torch.save``): load only records you trust.

    In a ``torch.distributed`` run (a ``DistributedDataParallel`` model, or one sharded with
    FSDP2 ``fully_shard``), every rank records into its own subfolder ``rank<r>`` of ``folder``
    (the world size in each ``index.json``), with the wrapped model's names (no ``module.``
    prefix) and the parameter gradients as the ranks share them (averaged, gathered whole);
    ``hs.compare(folder, b, *combined_inputs, ...)`` joins the ranks' values along the batch
    dimension and compares them with one process on the combined batch (see
    :func:`hookscope.compare`, ``loss_reduction``).

    Args:
        model: the model to record (compiled models get their eager names).
        folder: an empty or new folder.
        layers: record only these modules (a selector, see :func:`hookscope.find`); the calls a
            recorded module makes to unrecorded ones then run for real in the replay, so its
            local error covers them too.

    Example:
        >>> import copy, tempfile, torch, torch.nn as nn, hookscope as hs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(3, 4)
        >>> folder = tempfile.mkdtemp()
        >>> with hs.record(net, folder):
        ...     net(x).sum().backward()
        >>> net.zero_grad(set_to_none=True)
        >>> other = copy.deepcopy(net)
        >>> other[2].bias.data += 0.1
        >>> hs.compare(folder, other, x, loss_fn=lambda o: o.sum()).culprit
        '2'
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"hs.record: folder must be a str or os.PathLike (a new or empty folder), "
            f"got {type(folder).__name__}"
        )
    if Path(folder).exists() and not Path(folder).is_dir():
        raise CompareError(
            f"hs.record: {str(folder)!r} is not a folder (a file is there); give a new or empty "
            "folder"
        )
    return Record(model, Path(folder), layers)


def load_record(folder: str | os.PathLike[str], loss_reduction: str = "mean") -> RunRecord:
    """A folder written by :func:`record`, as a run whose values are read from disk on use; a
    folder written by several ranks is one run on the combined batch (:func:`join_ranks`)."""
    path = Path(folder)
    if not (path / "index.json").exists() and (path / "rank0" / "index.json").exists():
        return _load_ranks(path, loss_reduction)
    return _load_one(path)


def _load_ranks(path: Path, loss_reduction: str) -> RunRecord:
    world = json.loads((path / "rank0" / "index.json").read_text()).get("world", 1)
    missing = [r for r in range(world) if not (path / f"rank{r}" / "index.json").exists()]
    if missing:
        raise CompareError(
            f"hs.compare: {str(path)!r} was recorded on {world} ranks but holds no record of "
            f"rank(s) {missing}; wait for every rank to leave `hs.record`, or record again"
        )
    return join_ranks([_load_one(path / f"rank{r}") for r in range(world)], loss_reduction)


def _load_one(path: Path) -> RunRecord:
    index_path = path / "index.json"
    if not index_path.exists():
        raise CompareError(
            f"hs.compare: {str(path)!r} is not a record (no index.json): write one with "
            "`with hs.record(model, folder): ...`"
        )
    try:
        index = json.loads(index_path.read_text())
        entries, model = list(index["calls"]), index["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CompareError(
            f"hs.compare: {str(path)!r} is not a record written by hs.record (its index.json "
            f"cannot be read: {type(exc).__name__}); write one with `with hs.record(model, "
            "folder): ...`"
        ) from None
    n = index.get("model_calls", sum(1 for e in entries if e["name"] == ""))
    if n > 1:
        raise CompareError(
            f"hs.compare: the record {str(path)!r} holds {n} calls of the model ({model}); "
            "hs.compare compares one forward (and its backward): record each forward in a "
            "folder of its own (`with hs.record(model, folder): ...` around one call)"
        )
    store = ValueStore(0, path)
    calls = []
    for pos, e in enumerate(entries):
        c = CallRec(
            e["name"], e["index"], pos, e["parent"], alias=e["alias"], store=_Files(store, e, pos)
        )
        c.end, c.children = e["end"], list(e["children"])
        calls.append(c)
    params = torch.load(path / "params.pt", map_location="cpu", weights_only=False)
    return RunRecord(
        calls=calls,
        by_key={c.key: i for i, c in enumerate(calls)},
        param_grads=params,
        dtype=getattr(torch, index["dtype"]),
        has_grads=bool(index["grads"]),
        params=index["params"],
    )


class _Files:
    """The store of one recorded call: per-leaf gradient files put together into lists."""

    def __init__(self, store: ValueStore, entry: dict[str, Any], pos: int) -> None:
        self.store, self.entry, self.pos = store, entry, pos

    def get(self, key: str, default: Any = None) -> Any:
        for kind, n in (("ingrad", "n_in"), ("grad", "n_out")):
            if key == f"{kind}{self.pos}":
                return [self.store.get(f"{key}_{i}") for i in range(self.entry[n])]
        return self.store.get(key, default)

    def put(self, key: str, value: Any) -> None:
        raise CompareError("a record read from disk is read-only")
