"""``hookscope compare A B``: which module makes run B differ from run A.

``A`` and ``B`` are folders written by ``hs.record`` or models (the model spec the other commands
take). Two folders: errors per module call and the first divergent one (the culprit needs a live
``B``). A folder and a model: the model runs on the inputs the record holds. A model alone (or two
models) runs on random ``--input`` shapes, ``B`` being a copy of ``A`` changed by ``--b-dtype``,
``--autocast`` or ``--compile``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from ._main import CLIError, add_model_arguments, load, make_inputs

_LOSSES = ("none", "sum", "square")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="which module makes run B differ from run A (hs.compare)")
    add_model_arguments(p, compile=True)
    p.add_argument(
        "b",
        nargs="?",
        default=None,
        metavar="B",
        help="a record folder or a model spec; default: a copy of MODEL (see --b-dtype, "
        "--autocast, --compile)",
    )
    p.add_argument("--b-dtype", default=None, help="cast B's parameters to this dtype (bfloat16)")
    p.add_argument("--autocast", default=None, help="run B under torch.autocast(dtype)")
    p.add_argument(
        "--loss",
        choices=_LOSSES,
        default="sum",
        help="loss of the output's first tensor for the backward comparison (default: sum; "
        "none: forward only)",
    )
    p.add_argument(
        "--loss-reduction",
        choices=("mean", "sum"),
        default="mean",
        help="for a record made on several ranks: how each rank's loss reduced its share of the "
        "batch (default: mean)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="save the error plot to this file")
    p.set_defaults(func=run)


def _record_folder(text: str) -> Path | None:
    path = Path(text)
    if path.is_dir():
        if not (path / "index.json").exists() and not (path / "rank0" / "index.json").exists():
            raise CLIError(f"{text!r} is a folder but not a record (no index.json from hs.record)")
        return path
    return None


def _dtype(text: str | None, flag: str) -> Any:
    import torch

    if text is None:
        return None
    dt = getattr(torch, text, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise CLIError(f"unknown {flag} {text!r}; try bfloat16, float16 or float32")
    return dt


def _loss(kind: str) -> Any:
    if kind == "none":
        return None
    from ..core._nested import first_tensor

    if kind == "sum":
        return lambda o: first_tensor(o).float().sum()
    return lambda o: first_tensor(o).float().pow(2).mean()


def _live_b(args: argparse.Namespace, a: Any) -> Any:
    import torch

    if args.b is not None:
        spec_args = copy.copy(args)
        spec_args.model, spec_args.compile = args.b, None
        b = load(spec_args)
    else:
        b = copy.deepcopy(a)
    dt = _dtype(args.b_dtype, "--b-dtype")
    if dt is not None:
        b = b.to(dt)
    if args.compile is not None:
        b = torch.compile(b, backend=args.compile)
    return b


def run(args: argparse.Namespace) -> int:
    from ..compare._compare import compare
    from ..compare._record import load_record

    autocast = _dtype(args.autocast, "--autocast")
    loss = _loss(args.loss)
    folder_a = _record_folder(args.model)
    folder_b = _record_folder(args.b) if args.b is not None else None
    if folder_a is not None and folder_b is not None:
        report = compare(folder_a, folder_b, loss_reduction=args.loss_reduction)
    elif folder_a is not None:
        if args.b is None:
            raise CLIError("a record needs B: another record folder or a model spec")
        rec = load_record(folder_a, args.loss_reduction)
        root = rec.by_key.get(("", 0))
        if root is None or rec.calls[root].inputs is None:
            raise CLIError(f"{args.model!r} did not record the root module's inputs")
        inputs, kwargs = rec.calls[root].inputs
        b = _live_b(args, None)
        report = compare(
            folder_a,
            b,
            *inputs,
            loss_fn=loss,
            autocast=autocast,
            loss_reduction=args.loss_reduction,
            **kwargs,
        )
    else:
        saved = args.compile
        args.compile = None  # A runs eagerly; --compile applies to B
        a = load(args)
        args.compile = saved
        if folder_b is not None:
            raise CLIError(
                "compare a model against a record by giving the record first: A is the reference"
            )
        b = _live_b(args, a)
        inputs = make_inputs(args, a)
        report = compare(a, b, *inputs, loss_fn=loss, autocast=autocast)
    if args.plot:
        report.plot(args.plot)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report)
    return 0
