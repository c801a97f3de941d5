"""``hookscope summary MODEL --input SHAPE``: the per-layer table (or JSON) of one forward pass;
with ``--train``, the memory one training step keeps for backward (and ``--budget``: what to
checkpoint)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core._errors import HookscopeError
from ..summarization._format import parse_columns
from ..summarization._summary import summary
from ._main import CLIError, _one_line, add_model_arguments, load, make_inputs

if TYPE_CHECKING:
    import torch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summary", help="per-layer table: shapes, params, FLOPs, time, memory")
    add_model_arguments(p, compile=True)
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        metavar="N",
        help="fold layers deeper than N into their parent",
    )
    p.add_argument(
        "--columns",
        default=None,
        help="comma-separated: type,input,output,params,trainable,flops,time,bytes or 'all' "
        "(default: type,output,params,flops,time)",
    )
    p.add_argument(
        "--width",
        type=_positive_int,
        default=100,
        metavar="N",
        help="table width in characters (default 100)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--train",
        action="store_true",
        help="run one training step (train mode, loss = sum of the output) and print the bytes "
        "each layer saves for backward (hs.memory_profile)",
    )
    p.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="with --train: the layers to checkpoint so that the saved bytes fit SIZE "
        "(e.g. 4MB, 512KiB, 1000000)",
    )
    p.set_defaults(func=run)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def _positive_int(text: str) -> int:
    """``--width``: an int >= 1 (argparse reports the error as one line, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 (characters), got {text!r}")
    return n


def parse_size(text: str) -> int:
    """``"4MB" -> 4000000``, ``"512KiB" -> 524288``, ``"1000" -> 1000``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise CLIError(
            f"--budget {text!r} is not a size; e.g. 4MB, 512KiB, 2GiB or 1000000 (bytes)"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def run(args: argparse.Namespace) -> int:
    if args.depth is not None and args.depth < 0:
        raise CLIError(f"--depth must be >= 0; got {args.depth}")
    if args.budget is not None and not args.train:
        raise CLIError("--budget needs --train (it plans checkpointing for a training step)")
    if args.train:
        return run_train(args)
    columns = parse_columns(args.columns)  # fail on a typo before building the model
    model = load(args)
    inputs = make_inputs(args, model)
    try:
        s = summary(model, *inputs, depth=args.depth, columns=columns)
    except HookscopeError:
        raise  # hookscope's own refusal: its message is the reason (one line, exit 2)
    except Exception as e:
        # the summary hooks every module, the model itself included, so an error the model
        # raised names its layer; one that names none is not the model's: it is shown as it is
        # (a bug in hookscope keeps its traceback), never as "the model failed"
        if getattr(e, "hookscope_layer", None) is None:
            raise
        raise _model_failed(e, "on input", inputs) from None
    if args.json:
        print(s.to_json())
    else:
        print(s.to_text(width=args.width))
    return 0


def _model_failed(e: Exception, when: str, inputs: Sequence[torch.Tensor]) -> CLIError:
    """One line for a model that raised: the layer hookscope located, else the input shapes."""
    if getattr(e, "hookscope_layer", None) is not None:
        return CLIError(_one_line(e))
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    return CLIError(f"the model failed {when} {shapes}: {type(e).__name__}: {_one_line(e)}")


def run_train(args: argparse.Namespace) -> int:
    from ..memory._profile import memory_profile

    budget = parse_size(args.budget) if args.budget is not None else None
    model = load(args)
    inputs = make_inputs(args, model)
    model.train()
    try:
        prof = memory_profile(model, *inputs)
    except HookscopeError:
        raise
    except Exception as e:
        raise _model_failed(e, "in a training step on input", inputs) from None
    plan = prof.plan(budget) if budget is not None else None
    if args.json:
        out = prof.to_dict()
        if plan is not None:
            out["plan"] = {
                "modules": plan.modules,
                "budget_bytes": plan.budget_bytes,
                "predicted_saved_bytes": plan.predicted_saved_bytes,
                "predicted_drop": plan.predicted_drop,
                "recompute_flops": plan.recompute_flops,
            }
        print(json.dumps(out, indent=2))
        return 0
    print(prof.to_text(depth=args.depth, width=args.width))
    if plan is not None:
        print(plan)
    return 0
