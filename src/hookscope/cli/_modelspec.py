"""Naming a model on the command line: ``package.module:callable``, ``file.py:Name`` or ``demo``."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..core._errors import HookscopeError

__all__ = ["ModelSpecError", "load_model", "parse_shape", "parse_shapes"]


class ModelSpecError(HookscopeError):
    """A model spec or input shape given on the command line is not usable."""


def _split_call(target: str) -> tuple[str, dict[str, Any]]:
    """``resnet50(num_classes=10)`` -> ("resnet50", {"num_classes": 10})."""
    if "(" not in target:
        return target, {}
    if not target.endswith(")"):
        raise ModelSpecError(f"cannot parse {target!r}: expected name(key=value, ...)")
    name, _, rest = target.partition("(")
    try:
        call = ast.parse(f"f({rest}", mode="eval").body
    except SyntaxError as e:
        raise ModelSpecError(f"cannot parse the arguments in {target!r}: {e.msg}") from None
    assert isinstance(call, ast.Call)
    if call.args:
        raise ModelSpecError(f"{target!r}: give constructor arguments as key=value")
    try:
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    except ValueError:
        raise ModelSpecError(f"{target!r}: argument values must be Python literals") from None
    return name, kwargs


def load_model(spec: str) -> nn.Module:
    """Build the model a spec names.

    * ``demo``: hookscope's built-in demo CNN (trained weights shipped in the package).
    * ``package.module:callable`` e.g. ``torchvision.models:resnet50``; arguments may follow as
      ``torchvision.models:resnet50(num_classes=10)``. A class or factory is called; an
      ``nn.Module`` instance is used as is.
    * ``path/to/file.py:Name``: the same, from a Python file.

    Raises :class:`ModelSpecError` with one line saying what went wrong.
    """
    if spec == "demo":
        try:
            from ..demo._model import load_demo_model
        except ImportError:
            raise ModelSpecError("the built-in demo model is not available in this build") from None
        return load_demo_model()
    if ":" not in spec:
        raise ModelSpecError(
            f"model {spec!r}: expected 'package.module:callable' (e.g. torchvision.models:resnet50), "
            "'path/to/file.py:Name' or 'demo'"
        )
    where, _, target = spec.rpartition(":")
    name, kwargs = _split_call(target)
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ModelSpecError(f"model file {where!r} does not exist")
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        mod_name = f"_hookscope_user_{path.stem}_{digest}"  # stable across processes
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModelSpecError(f"cannot import {where!r} as a Python file")
        mod = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = mod
        try:
            module_spec.loader.exec_module(mod)
        except Exception as e:
            raise ModelSpecError(f"importing {where!r} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise ModelSpecError(f"cannot import module {where!r}: {e}") from None
    obj: Any = mod
    for part in name.split("."):
        if not hasattr(obj, part):
            options = [n for n in dir(obj) if not n.startswith("_")]
            import difflib

            close = difflib.get_close_matches(part, options, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ModelSpecError(f"{where!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        if kwargs:
            raise ModelSpecError(f"{name!r} is a module instance; it takes no arguments")
        return obj
    if not callable(obj):
        raise ModelSpecError(f"{spec!r} is a {type(obj).__name__}, not a model class or factory")
    try:
        model = obj(**kwargs)
    except Exception as e:
        raise ModelSpecError(f"building {spec!r} failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` (or ``1x3x224x224``) -> ``(1, 3, 224, 224)``."""
    parts = re.split(r"[,x×]", text.strip().strip("()[]").replace(" ", ""))
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ModelSpecError(
            f"bad shape {text!r}: expected comma-separated positive integers like 1,3,224,224"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise ModelSpecError(
            f"bad shape {text!r}: expected comma-separated positive integers like 1,3,224,224"
        )
    return shape


def parse_shapes(texts: list[str] | None) -> list[tuple[int, ...]]:
    """Several ``--input`` values; ``"1,3,8,8;1,10"`` also separates inputs."""
    out: list[tuple[int, ...]] = []
    for t in texts or []:
        out.extend(parse_shape(p) for p in t.split(";") if p.strip())
    return out
