"""``hookscope summary MODEL --input SHAPE``: the per-layer table (or JSON) of one forward pass."""

from __future__ import annotations

import argparse

from ..summarization._format import parse_columns
from ..summarization._summary import summary
from ._main import CLIError, _one_line, add_model_arguments, load, make_inputs


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
    p.add_argument("--width", type=int, default=100, help="table width in characters (default 100)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.depth is not None and args.depth < 0:
        raise CLIError(f"--depth must be >= 0; got {args.depth}")
    columns = parse_columns(args.columns)  # fail on a typo before building the model
    model = load(args)
    inputs = make_inputs(args, model)
    try:
        s = summary(model, *inputs, depth=args.depth, columns=columns)
    except Exception as e:
        if getattr(e, "hookscope_layer", None) is not None:
            raise CLIError(_one_line(e)) from None
        raise CLIError(
            f"the model failed on input {', '.join(str(tuple(t.shape)) for t in inputs)}: {type(e).__name__}: {_one_line(e)}"
        ) from None
    if args.json:
        print(s.to_json())
    else:
        print(s.to_text(width=args.width))
    return 0
