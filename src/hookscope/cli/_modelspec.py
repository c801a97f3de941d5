"""Naming a model on the command line: ``package.module:callable``, ``file.py:Name``, ``hf:CONFIG``
or ``demo``."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..core._errors import HookscopeError

__all__ = ["ModelSpecError", "load_model", "parse_shape", "parse_shapes", "random_weights"]


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
    * ``hf:CONFIG[@AutoClass]``: a Hugging Face model with random weights, built by
      ``AutoClass.from_config`` (``AutoModel`` unless named) from ``CONFIG``: a ``config.json``
      (or a folder holding one), or a transformers config class with arguments, e.g.
      ``hf:GPT2Config(n_layer=2, n_embd=64, n_head=2)@AutoModelForCausalLM``. Nothing is
      downloaded.

    Raises :class:`ModelSpecError` with one line saying what went wrong.
    """
    if spec == "demo":
        try:
            from ..demo._model import load_demo_model
        except ImportError:
            raise ModelSpecError("the built-in demo model is not available in this build") from None
        return load_demo_model()
    if spec.startswith("hf:"):
        return _load_hf(spec[3:])
    if ":" not in spec:
        raise ModelSpecError(
            f"model {spec!r}: expected 'package.module:callable' (e.g. torchvision.models:resnet50), "
            "'path/to/file.py:Name', 'hf:path/to/config.json' or 'demo'"
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


def random_weights(spec: str) -> str | None:
    """Why the model ``spec`` builds has random weights, or ``None`` when it has trained ones or
    this cannot be told. Known: a Hugging Face config (``hf:``, always built with random weights)
    and a factory with a ``weights=`` or ``pretrained=`` parameter called without it (torchvision's
    ``resnet50``, ``vit_b_16``, ...; timm's ``create_model``). A class, a module instance and a
    ``file.py:Name`` spec are taken as they are.

    Example:
        >>> random_weights("torchvision.models:resnet18(num_classes=10)")
        "built without weights=: its weights are random, so its predictions reflect no training (for trained weights: resnet18(weights='DEFAULT'))"
        >>> random_weights("torchvision.models:resnet18(weights='DEFAULT')") is None
        True
    """
    if spec.startswith("hf:"):
        return "built from a config: its weights are random, so its predictions reflect no training"
    if ":" not in spec or spec == "demo":
        return None
    where, _, target = spec.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        return None
    try:
        name, kwargs = _split_call(target)
        obj: Any = sys.modules.get(where) or importlib.import_module(where)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception:  # the spec itself failed: load_model says why
        return None
    if isinstance(obj, type) or not callable(obj):
        return None
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    for flag, value in (("weights", "'DEFAULT'"), ("pretrained", "True")):
        if flag in params and not kwargs.get(flag):
            short = name.rpartition(".")[2]
            return (
                f"built without {flag}=: its weights are random, so its predictions reflect no "
                f"training (for trained weights: {short}({flag}={value}))"
            )
    return None


def _load_hf(ref: str) -> nn.Module:
    """``hf:CONFIG[@AutoClass]`` (see :func:`load_model`)."""
    config_ref, _, auto = ref.rpartition("@") if "@" in ref else (ref, "", "AutoModel")
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "hf: models need transformers: pip install 'hookscope[transformers]'"
        ) from None
    name, kwargs = _split_call(config_ref)
    if "(" in config_ref or (not config_ref.endswith(".json") and hasattr(transformers, name)):
        cls = getattr(transformers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
            raise ModelSpecError(
                f"hf:{ref}: {name!r} is not a transformers config class (e.g. BertConfig, GPT2Config)"
            )
        try:
            config = cls(**kwargs)
        except Exception as e:
            raise ModelSpecError(f"hf:{ref}: {name}(...) failed: {type(e).__name__}: {e}") from None
    else:
        path = Path(config_ref)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ModelSpecError(
                f"hf:{ref}: no config file {str(path)!r}; give a config.json, a folder holding "
                "one, or a config class such as hf:BertConfig(num_hidden_layers=2)"
            )
        try:
            config = transformers.AutoConfig.from_pretrained(str(path))
        except Exception as e:
            raise ModelSpecError(f"hf:{ref}: cannot read {str(path)!r}: {e}") from None
    builder = getattr(transformers, auto, None)
    if builder is None or not hasattr(builder, "from_config"):
        raise ModelSpecError(
            f"hf:{ref}: {auto!r} is not a transformers Auto class "
            "(e.g. AutoModel, AutoModelForCausalLM, AutoModelForImageClassification)"
        )
    try:
        return builder.from_config(config)
    except Exception as e:
        raise ModelSpecError(f"hf:{ref}: {auto}.from_config failed: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


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
