"""``hookscope trace MODEL --input SHAPE``: print every layer call of one forward pass."""

from __future__ import annotations

import argparse

import torch

from ..core._trace import trace
from ._main import add_model_arguments, load, make_inputs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="print each layer call (shapes, dtype, device, time) of one forward"
    )
    add_model_arguments(p, compile=True)
    p.add_argument(
        "--layers", default=None, help="comma-separated names or globs to show (default: all)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load(args)
    inputs = make_inputs(args, model)
    layers = [s for s in args.layers.split(",") if s] if args.layers else None
    with torch.no_grad(), trace(model, layers):
        model(*inputs)
    return 0
