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

from ._main import CLIError, add_model_arguments, compiled, load, make_inputs

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
        default=None,
        help="loss of the output's first tensor for the backward comparison (default: sum; "
        "none: forward only)",
    )
    p.add_argument(
        "--loss-reduction",
        choices=("mean", "sum"),
        default=None,
        help="for a record made on several ranks: how each rank's loss reduced its share of the "
        "batch (default: mean)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="save the error plot to this file")
    # None: not given (an option that does not apply to the runs given is refused, not ignored)
    p.set_defaults(func=run, dtype=None, device=None)


def _record_folder(text: str) -> Path | None:
    path = Path(text)
    if path.is_dir():
        if not (path / "index.json").exists() and not (path / "rank0" / "index.json").exists():
            raise CLIError(f"{text!r} is a folder but not a record (no index.json from hs.record)")
        return path
    if ":" not in text and text != "demo" and not path.suffix:
        # no model spec has neither a colon nor a suffix: a record folder that is not there
        raise CLIError(
            f"{text!r}: no such record folder (nor a model spec: 'package.module:callable', "
            "'path/to/file.py:Name', 'hf:path/to/config.json' or 'demo')"
        )
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
        b = compiled(b, args.compile)
    return b


# options that run or feed a live model: (flag, attribute); None when not given
_LIVE = (
    ("--autocast", "autocast"),
    ("--loss", "loss"),
    ("--b-dtype", "b_dtype"),
    ("--compile", "compile"),
    ("--input", "input"),
    ("--dtype", "dtype"),
    ("--device", "device"),
)


def _refuse_ignored(args: argparse.Namespace, folder_a: Path | None, folder_b: Path | None) -> None:
    """An option given that does not apply to the runs given is bad input, not ignored."""
    from ..compare._record import of_ranks

    if folder_a is not None and folder_b is not None:
        given = [flag for flag, attr in _LIVE if getattr(args, attr) is not None]
        if given:
            raise CLIError(
                f"{', '.join(given)}: two records are runs already made (read on the CPU), and "
                f"{'this option applies' if len(given) == 1 else 'these options apply'} only to "
                "a live model B; leave it out, or give a model spec as B"
            )
    elif folder_a is not None:
        given = [flag for flag, attr in _LIVE[4:6] if getattr(args, attr) is not None]
        if given:
            raise CLIError(
                f"{', '.join(given)}: B runs on the inputs the record {str(folder_a)!r} holds; "
                "leave it out"
            )
    if args.loss_reduction is not None and not any(
        f is not None and of_ranks(f) for f in (folder_a, folder_b)
    ):
        raise CLIError(
            "--loss-reduction applies only to a record made on several ranks (how each rank's "
            "loss reduced its share of the batch), and no record given here is one; leave it out"
        )


def run(args: argparse.Namespace) -> int:
    from ..compare._compare import compare
    from ..compare._record import load_record

    if args.plot:
        _check_plot(args.plot)  # before the runs: a bad path must not cost the comparison
    folder_a = _record_folder(args.model)
    folder_b = _record_folder(args.b) if args.b is not None else None
    _refuse_ignored(args, folder_a, folder_b)
    args.dtype = args.dtype or "float32"
    args.device = args.device or "cpu"
    reduction = args.loss_reduction or "mean"
    autocast = _dtype(args.autocast, "--autocast")
    loss = _loss(args.loss or "sum")
    if folder_a is not None and folder_b is not None:
        report = compare(folder_a, folder_b, loss_reduction=args.loss_reduction)
    elif folder_a is not None:
        if args.b is None:
            raise CLIError("a record needs B: another record folder or a model spec")
        rec = load_record(folder_a, reduction)
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
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report)
    if args.plot:  # after the report is out
        report.plot(args.plot)
    return 0


_PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _check_plot(path: str) -> None:
    """``--plot`` names a file to write, with a suffix matplotlib writes, in a folder that is."""
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"--plot {path!r} is a folder; give a file name ending in .png")
    if p.suffix.lower() not in _PLOT_SUFFIXES:
        raise CLIError(
            f"--plot {path!r}: give a file name ending in {', '.join(_PLOT_SUFFIXES)} (the format "
            "is read from it)"
        )
    if not p.parent.is_dir():
        raise CLIError(f"--plot {path!r}: the folder {str(p.parent)!r} does not exist")
