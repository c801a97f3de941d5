"""The ``hookscope`` command line. Each subcommand lives in its own module (``_trace.py``,
``_summary.py``, ...) exposing ``register(subparsers)``; this file only dispatches and turns user
errors into one line on stderr with exit code 2 (never a traceback)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from ..core._errors import HookscopeError
from ._hints import check_positions, token_input, vocabulary, with_hint

__all__ = ["CLIError", "main", "random_weights_note"]

# Subcommand modules, in the order they are listed by --help.
COMMANDS = ["_trace", "_summary", "_extract", "_cam", "_demo", "_compare"]


class CLIError(HookscopeError):
    """Bad command-line input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse prints usage + message)
        # self.prog: "hookscope" for the top-level parser, "hookscope summary" for a subcommand
        self.exit(2, f"hookscope: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = _Parser(prog="hookscope", description="Look inside any PyTorch model through hooks.")
    parser.add_argument("--version", action="version", version=f"hookscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod_name in COMMANDS:
        importlib.import_module(f"{__package__}.{mod_name}").register(sub)
    parser.set_defaults(_commands=sub.choices)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown option is reported by the subcommand it was given to (argparse
    reports it from the top-level parser, which would point at ``hookscope --help``)."""
    args, extra = parser.parse_known_args(argv)
    commands = vars(args).pop("_commands", {})  # not part of the command's arguments
    if extra:
        owner = commands.get(getattr(args, "command", None), parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    layer = getattr(exc, "hookscope_layer", None)
    if layer is not None:
        shown = layer or "<root>"
        return f"the model failed in layer {shown!r} (input {exc.hookscope_inputs}): {type(exc).__name__}: {msg}"  # type: ignore[attr-defined]
    return msg


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hookscope`` console script; returns the exit code."""
    parser = build_parser()
    args = _parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `hookscope trace ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("hookscope: interrupted", file=sys.stderr)
        return 130
    except (HookscopeError, FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as e:
        print(f"hookscope: error: {with_hint(_one_line(e), args)}", file=sys.stderr)
        return 2
    except Exception as e:
        # an exception raised inside the user's model (located by `load`'s error locator) is bad
        # input: one line, exit 2. Anything else is a bug in hookscope: let the traceback show.
        if getattr(e, "hookscope_layer", None) is not None:
            print(f"hookscope: error: {with_hint(_one_line(e), args)}", file=sys.stderr)
            return 2
        raise
    finally:
        while _LOCATORS:
            _LOCATORS.pop().remove()


def add_model_arguments(
    p: argparse.ArgumentParser, *, inputs: bool = True, compile: bool = False
) -> None:
    """The MODEL positional and the --input/--dtype/--device options shared by subcommands."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="package.module:callable, path/to/file.py:Name, hf:path/to/config.json, or demo",
    )
    if inputs:
        p.add_argument(
            "--input",
            action="append",
            metavar="SHAPE",
            help="input shape, e.g. 1,3,224,224 (repeat for several inputs)",
        )
        p.add_argument(
            "--dtype",
            default="float32",
            help="input dtype (float32, float16, bfloat16, long, ...); token ids: long",
        )
    p.add_argument("--device", default="cpu", help="device to run on (cpu, cuda, cuda:1)")
    if compile:
        p.add_argument(
            "--compile",
            nargs="?",
            const="inductor",
            default=None,
            metavar="BACKEND",
            help="run the model through torch.compile (backend: inductor unless named, e.g. "
            "--compile eager); hookscope gives the same layer names and values as without",
        )


def make_inputs(args: argparse.Namespace, model: Any) -> list[Any]:
    """Random inputs for --input shapes (or the demo model's default input)."""
    import torch

    from ._modelspec import parse_shapes

    shapes = parse_shapes(args.input)
    if not shapes:
        default = getattr(model, "default_input_shape", None)
        if default is None:
            raise CLIError("--input is required for this model, e.g. --input 1,3,224,224")
        shapes = [tuple(default)]
    try:
        dtype = getattr(torch, args.dtype)
        assert isinstance(dtype, torch.dtype)
    except (AttributeError, AssertionError):
        raise CLIError(
            f"unknown --dtype {args.dtype!r}; try float32, float16, bfloat16 or long"
        ) from None
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CLIError(f"unknown --device {args.device!r}; try cpu or cuda") from None
    tokens = token_input(model)
    if tokens is not None and dtype.is_floating_point:
        raise CLIError(
            f"the model takes token ids ({tokens}), not {args.dtype} values: add --dtype long"
        )
    if tokens is not None and any(len(s) != 2 for s in shapes):
        bad = next(",".join(map(str, s)) for s in shapes if len(s) != 2)
        raise CLIError(
            f"--input {bad}: token ids are (batch, sequence), e.g. --input 1,16 --dtype long"
        )
    too_long = check_positions(model, shapes, dtype)
    if too_long is not None:
        raise CLIError(too_long)
    gen = torch.Generator().manual_seed(0)
    high = min(100, vocabulary(model) or 100)  # token ids must be inside the vocabulary
    out = []
    for s in shapes:
        try:
            if dtype.is_floating_point:
                out.append(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
            else:
                out.append(torch.randint(0, high, s, generator=gen).to(device=device, dtype=dtype))
        except RuntimeError as e:  # a dtype no input is made of (qint8): a traceback before
            raise CLIError(
                f"--dtype {args.dtype}: cannot make inputs of it on {args.device!r} "
                f"({_one_line(e)}); try float32, float16, bfloat16 or long"
            ) from None
    return out


_LOCATORS: list[Any] = []


def random_weights_note(args: argparse.Namespace) -> str | None:
    """The note printed under predictions of a model with random weights, or ``None``."""
    why = getattr(args, "random_weights", None)
    if why is None:
        return None
    return f"note: the model was {why}"


def load(args: argparse.Namespace) -> Any:
    """Load MODEL (eval mode, on --device), with an error locator attached until :func:`main`
    returns, so an exception inside the model is reported as one line naming the layer. Sets
    ``args.random_weights`` (why the model's weights are random, or ``None``: see
    :func:`random_weights_note`)."""
    import torch

    from ..core._scope import check_model, locate_errors
    from ._modelspec import load_model, random_weights

    model = load_model(args.model)
    check_model(model)  # a TorchScript module: refused in one line, before any hook fails on it
    args.random_weights = random_weights(args.model)
    try:
        model = model.to(torch.device(getattr(args, "device", "cpu")))
    except RuntimeError as e:
        raise CLIError(f"cannot move the model to {args.device!r}: {e}") from None
    model.eval()
    backend = getattr(args, "compile", None)
    if backend is None:
        _LOCATORS.append(locate_errors(model))
        return model
    # compiled: no error locator (a hook on every module would break the graph at every layer);
    # an error inside the model is still reported as one line
    return compiled(model, backend)


def compiled(model: Any, backend: str) -> Any:
    """``torch.compile(model, backend=backend)``; a backend torch does not know is one line."""
    import torch

    try:
        return torch.compile(model, backend=backend)  # attributes read through to the model
    except Exception as e:
        raise CLIError(f"--compile {backend}: {_one_line(e)}") from None
