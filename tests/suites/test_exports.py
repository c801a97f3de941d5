"""The public namespace is exactly the sorted, explicit ``__all__`` (httpx's test, adapted)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import hookscope


def test_all_is_sorted_and_matches_public_names():
    assert hookscope.__all__ == sorted(hookscope.__all__)
    public = {n for n in dir(hookscope) if not n.startswith("_")}
    # the product packages are the layout, not API (``ops`` is a public module; ``compare`` is
    # both a package and the function ``hs.compare`` it exports)
    public -= {m.name for m in pkgutil.iter_modules(hookscope.__path__)} - {"ops", "compare"}
    assert public == set(hookscope.__all__) - {"__version__"}


def _all_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(hookscope.__path__, "hookscope.")]


def test_every_module_has_explicit_all():
    # command modules only expose register(subparsers); __main__ runs the CLI
    skip = {"hookscope.__main__"} | {
        n for n in _all_modules() if n.startswith("hookscope.cli._") and n != "hookscope.cli._main"
    }
    for name in _all_modules():
        if name in skip:
            continue
        mod = importlib.import_module(name)
        assert hasattr(mod, "__all__"), f"{name} has no __all__"


def test_layout_has_one_package_per_product():
    packages = {m.name for m in pkgutil.iter_modules(hookscope.__path__) if m.ispkg}
    assert packages == {
        "cam",
        "cli",
        "compare",
        "core",
        "demo",
        "extraction",
        "integrations",
        "memory",
        "monitor",
        "patching",
        "steering",
        "summarization",
        "viz",
    }


def test_every_public_function_has_an_example():
    """Each public function carries a ``>>>`` example in its docstring (``make test``
    runs them through ``--doctest-modules``; this only checks they are there)."""
    finder = doctest.DocTestFinder(recurse=False)
    missing = []
    for name in hookscope.__all__:
        obj = getattr(hookscope, name)
        if not inspect.isfunction(obj):
            continue
        if not any(t.examples for t in finder.find(obj, name)):
            missing.append(name)
    assert not missing, f"public names without a docstring example: {missing}"


def _python(code: str) -> str:
    """What a fresh interpreter running ``code`` prints (stripped)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_loads_no_optional_extra():
    """``import hookscope`` needs torch and NumPy only; extras are imported when used (tqdm is
    left out: torch itself imports it)."""
    code = (
        "import sys, hookscope; "
        "print(sorted(m for m in ('matplotlib', 'PIL', 'rich', 'tensorboard', "
        "'torchvision', 'lightning', 'transformers', 'accelerate', 'wandb', 'mlflow') "
        "if m in sys.modules))"
    )
    assert _python(code) == "[]"


def test_a_plain_model_does_not_import_dtensor():
    """A Monitor or a capture on a model without DTensor parameters leaves
    ``torch.distributed.tensor`` unimported (importing it costs ~0.5 s; no DTensor can exist
    without it), while one on a DTensor parameter still sees it (tests/suites/test_sharded.py)."""
    code = (
        "import sys, torch, hookscope as hs; net = hs.DemoNet(); "
        "mon = hs.Monitor(net, alerts='off', sentinel=True); "
        "net(torch.randn(2, 3, 16, 16)).sum().backward(); mon.step(); mon.close(); "
        "cap = hs.capture(net, 'stage1.1', grads=True)\n"
        "with cap: net(torch.randn(2, 3, 16, 16)).sum().backward()\n"
        "print('torch.distributed.tensor' in sys.modules, tuple(cap.grads['stage1.1'].shape))"
    )
    assert _python(code) == "False (2, 16, 16, 16)"


def test_only_the_core_scope_registers_hooks():
    """Every hook goes through ``core._scope.HookScope`` (removed on exit, listed as hookscope's):
    no other module calls a ``register_*hook*`` function (docstrings are not code)."""
    import ast
    from pathlib import Path

    root = Path(hookscope.__file__).parent
    allowed = root / "core" / "_scope.py"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name.startswith("register_") and "hook" in name:
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert offenders == []


def test_architecture_page_names_every_source_file():
    """docs/ARCHITECTURE.md gives each file of the package one line: a new file needs its line."""
    from pathlib import Path

    root = Path(hookscope.__file__).parent
    page = (root.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(f.relative_to(root))
        for f in sorted(root.rglob("*.py"))
        if f.name != "__init__.py"
        and f"`{f.name}`" not in page
        and f"`{f.relative_to(root)}`" not in page
    ]
    assert not missing, f"files without a line in docs/ARCHITECTURE.md: {missing}"


def test_the_tests_tree_mirrors_the_packages():
    """Each product package has ``tests/<package>/`` with a test file; the other folders are the
    shared ``helpers/`` and the cross-cutting ``suites/``; no loose test files at the root; test
    file basenames are unique (pytest's rootdir-relative imports need it)."""
    from collections import Counter
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    packages = {m.name for m in pkgutil.iter_modules(hookscope.__path__) if m.ispkg}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - packages == {"helpers", "suites"}
    assert sorted(p for p in packages if not any((tests / p).rglob("test_*.py"))) == []
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert sorted(n for n, k in names.items() if k > 1) == []
