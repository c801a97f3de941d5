"""Sphinx extension: the API reference, generated at build time from ``hookscope.__all__``.

Every public name gets an entry on the page of the package it lives in (``obj.__module__``:
``hookscope.core._capture.capture`` goes on the ``core`` page). The packages docs/ARCHITECTURE.md
names have a title and a place; a package it does not name yet (a new product) gets a page titled
by the first line of its docstring, after the known products. The integrations' public classes
(``__all__`` of each ``hookscope.integrations.<name>`` module) get a page too. The build fails
(``-W``) when a public name has no entry.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

# (package, title, one-line lead) in the order docs/ARCHITECTURE.md draws them: core first, then
# the products, then what sits above them. A package not listed lands after the products.
KNOWN = [
    ("core", "Core: select, capture, edit, observe, trace", "The engine every product uses."),
    ("summarization", "Model summary", "One row per module call: shapes, parameters, FLOPs, time."),
    ("cam", "Grad-CAM", "The CAM family over one template; ViT/Swin token layers."),
    ("monitor", "Training health", "Per-layer statistics, alerts, sinks, the NaN/Inf origin."),
    ("extraction", "Feature extraction", "FeatureExtractor and extract() to disk."),
    ("viz", "Pictures", "CAM overlays and feature-map grids."),
    ("patching", "Activation patching", "Patching sweeps and attribution patching on any model."),
    ("steering", "Steering", "Steering vectors and steering inside generate()."),
    ("memory", "Training memory", "Bytes saved for backward per module; checkpointing plans."),
]
TAIL = [
    ("demo", "Demo model and data", "The built-in demo CNN and its data set."),
    ("integrations", "Trainer integrations", "Lightning and Hugging Face callbacks."),
    ("hookscope", "Package", "Package-level values."),
]


@dataclass
class Group:
    package: str
    title: str
    lead: str
    entries: list[tuple[str, str]] = field(default_factory=list)  # (directive, dotted name)


def _package_of(name: str, obj: object) -> str:
    """The ``hookscope.<package>`` an exported object lives in (``"hookscope"`` for plain data)."""
    if inspect.ismodule(obj):
        members = [getattr(obj, m) for m in getattr(obj, "__all__", [])]
        mods = [getattr(m, "__module__", "") for m in members]
        module = next((m for m in mods if m and m.startswith("hookscope.")), obj.__name__)
    else:
        module = getattr(obj, "__module__", None) or ""
    parts = module.split(".")
    if parts[0] == "hookscope" and len(parts) > 1 and not parts[1].startswith("_"):
        sub = f"hookscope.{parts[1]}"
        if sub in sys.modules and hasattr(sys.modules[sub], "__path__"):
            return parts[1]
    # an alias whose __module__ is typing's (Selector = Union[...]): the package exporting it
    for mod_name, mod in sorted(sys.modules.items()):
        parts = mod_name.split(".")
        if (
            len(parts) == 2
            and parts[0] == "hookscope"
            and hasattr(mod, "__path__")
            and name in getattr(mod, "__all__", ())
            and getattr(mod, name, None) is obj
        ):
            return parts[1]
    return "hookscope"


def _directive(obj: object) -> str:
    if inspect.ismodule(obj):
        return "automodule"
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "autofunction"
    return "autodata"


def collect() -> list[Group]:
    """The API pages: one group per package, in the order they appear on the site."""
    import hookscope

    found: dict[str, list[tuple[str, str]]] = {}
    for name in hookscope.__all__:
        obj = getattr(hookscope, name)
        target = obj.__name__ if inspect.ismodule(obj) else f"hookscope.{name}"
        found.setdefault(_package_of(name, obj), []).append((_directive(obj), target))
    import hookscope.integrations as integ

    for info in pkgutil.iter_modules(integ.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"hookscope.integrations.{info.name}")
        for name in mod.__all__:
            found.setdefault("integrations", []).append(
                (_directive(getattr(mod, name)), f"{mod.__name__}.{name}")
            )
    known = {p: (t, lead) for p, t, lead in KNOWN + TAIL}
    new = sorted(p for p in found if p not in known)
    order = [p for p, _, _ in KNOWN] + new + [p for p, _, _ in TAIL]
    groups = []
    for package in order:
        if package not in found:
            continue
        if package in known:
            title, lead = known[package]
        else:
            doc = inspect.getdoc(sys.modules[f"hookscope.{package}"]) or package
            title, lead = package.capitalize(), doc.strip().splitlines()[0]
        groups.append(Group(package, title, lead, found[package]))
    return groups


def _options(directive: str) -> list[str]:
    if directive in ("autoclass", "autoexception"):
        return ["   :members:", "   :show-inheritance:"]
    if directive == "automodule":
        return ["   :members:"]
    if directive == "autodata":
        return ["   :annotation:"]
    return []


def _page(g: Group) -> str:
    title = f"{g.title} (``hookscope.{g.package}``)" if g.package != "hookscope" else g.title
    lines = [title, "=" * len(title), "", g.lead, ""]
    lines += [".. autosummary::", "   :nosignatures:", ""]
    lines += [f"   ~{target}" for _, target in g.entries]
    lines.append("")
    for directive, target in g.entries:
        lines += [f".. {directive}:: {target}", *_options(directive), ""]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    # rewrite only on change, so an incremental build does not re-read every page
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def generate(app: Sphinx) -> None:
    out = Path(app.srcdir) / "api"
    out.mkdir(exist_ok=True)
    groups = collect()
    app.env.hookscope_api_names = [t for g in groups for _, t in g.entries]
    index = [
        "API reference",
        "=============",
        "",
        "Generated from ``hookscope.__all__`` and the integrations' public classes, grouped by the",
        "package each name lives in (docs/ARCHITECTURE.md draws them). Every name is used as",
        "``hookscope.<name>``.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
    ]
    index += [f"   {g.package}" for g in groups]
    _write(out / "index.rst", "\n".join(index) + "\n")
    keep = {"index.rst"}
    for g in groups:
        _write(out / f"{g.package}.rst", _page(g))
        keep.add(f"{g.package}.rst")
    for stale in out.glob("*.rst"):
        if stale.name not in keep:
            stale.unlink()


def check(app: Sphinx, env) -> None:
    """Every public name has an entry in the Python domain (``-W`` turns this into a failure)."""
    objects = env.get_domain("py").objects
    for name in getattr(env, "hookscope_api_names", []):
        if name not in objects:
            logger.warning("API reference: %s has no entry (is its docstring importable?)", name)


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", generate)
    app.connect("env-check-consistency", check)
    return {"parallel_read_safe": True, "version": "1"}
