"""The documentation site, checked as a user meets it: built from a copy of docs/ (every tutorial
executed, warnings as errors), every internal link and anchor resolves, every public name has an
API entry, every tutorial ran and shows its outputs, and headless Chromium renders the pages with
their styles and pictures."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import time
import types
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import hookscope
import hookscope.integrations

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TUTORIALS = sorted(p.stem for p in (DOCS / "tutorials").glob("tutorial_*.py"))
GENERATED = ("_build", "api", "auto_tutorials", "sg_execution_times.rst")
CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)

# what `make docs` runs
SPHINX = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q"]
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=10000",
]


class _Page(HTMLParser):
    """The ids, links and images of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.classes: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])  # type: ignore[arg-type]
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])  # type: ignore[arg-type]
        if tag in ("a", "link") and a.get("href"):
            self.links.append(a["href"])  # type: ignore[arg-type]
        if tag in ("img", "script") and a.get("src"):
            (self.images if tag == "img" else self.links).append(a["src"])  # type: ignore[arg-type]
        self.classes += (a.get("class") or "").split()


def _parse(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``make docs``'s command on a fresh copy of docs/ (no generated files, so every tutorial
    runs), with this checkout's hookscope first on the path."""
    tmp = tmp_path_factory.mktemp("site")
    src = tmp / "docs"
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns(*GENERATED, "__pycache__"))
    env = dict(os.environ, MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = tmp / "html"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*SPHINX, "-d", str(tmp / "doctrees"), str(src), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    print(f"site built in {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, (
        f"the site build failed (a warning, or a tutorial that raised):\n{proc.stderr[-6000:]}"
    )
    return out


@pytest.mark.slow
def test_every_tutorial_ran_and_shows_its_output(site):
    assert TUTORIALS, "no docs/tutorials/tutorial_*.py"
    index = (site / "auto_tutorials" / "index.html").read_text(encoding="utf-8")
    for name in TUTORIALS:
        page = site / "auto_tutorials" / f"{name}.html"
        assert page.is_file(), f"{name}.py has no page"
        assert f"{name}.html" in index, f"the tutorial index does not list {name}"
        html = page.read_text(encoding="utf-8")
        assert "Traceback (most recent call last)" not in html, f"{name} printed a traceback"
        p = _parse(page)
        assert "sphx-glr-script-out" in p.classes, f"{name} shows no output"
        for img in p.images:
            assert (page.parent / unquote(urlsplit(img).path)).is_file(), f"{name}: {img}"
    # the tutorials that draw show their pictures
    for name, least in {
        "tutorial_pictures": 4,
        "tutorial_gradcam": 3,
        "tutorial_training": 1,
    }.items():
        if name in TUTORIALS:
            assert len(_parse(site / "auto_tutorials" / f"{name}.html").images) >= least, name


def _public() -> list[str]:
    """Every name the API reference must have: ``hookscope.__all__`` and the integrations'."""
    names = []
    for n in hookscope.__all__:
        obj = getattr(hookscope, n)
        names.append(obj.__name__ if inspect.ismodule(obj) else f"hookscope.{n}")
    for info in pkgutil.iter_modules(hookscope.integrations.__path__):
        if not info.name.startswith("_"):
            mod = importlib.import_module(f"hookscope.integrations.{info.name}")
            names += [f"{mod.__name__}.{n}" for n in mod.__all__]
    return names


@pytest.mark.slow
def test_every_public_name_has_an_api_entry(site):
    ids: dict[str, str] = {}
    for page in sorted((site / "api").glob("*.html")):
        for i in _parse(page).ids:
            ids.setdefault(i, page.name)
    missing = []
    for name in _public():
        key = f"module-{name}" if name == "hookscope.ops" else name
        if key not in ids:
            missing.append(name)
    assert not missing, f"no API entry for {missing}"
    # grouped by package: capture on the core page, GradCAM on the CAM page, the callbacks on theirs
    assert ids["hookscope.capture"] == "core.html" and ids["hookscope.GradCAM"] == "cam.html"
    assert ids["hookscope.integrations.lightning.HookscopeCallback"] == "integrations.html"
    # the docstrings are rendered, not just the names
    core = (site / "api" / "core.html").read_text(encoding="utf-8")
    assert "cap.stopped" in core and "the rest of the block is skipped" in core


@pytest.mark.slow
def test_no_broken_internal_link(site):
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    broken = []
    for page, parsed in pages.items():
        for href in parsed.links + parsed.images:
            u = urlsplit(href)
            if u.scheme or href.startswith(("//", "mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(u.path)).resolve() if u.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href}")
            elif u.fragment and target.suffix == ".html":
                ids = (pages.get(target) or _parse(target)).ids
                if u.fragment not in ids:
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken[:40])


_PROBE = (
    "<script>addEventListener('load',()=>{const imgs=[...document.images].map(i=>"
    "i.complete&&i.naturalWidth>0?'ok':'BROKEN:'+i.getAttribute('src'));"
    "const r={title:document.title,sheets:document.styleSheets.length,imgs:imgs,"
    "font:getComputedStyle(document.body).fontFamily,h1:(document.querySelector('h1')||{}).textContent||''};"
    "const p=document.createElement('pre');p.id='probe';p.textContent=JSON.stringify(r);"
    "document.body.appendChild(p);});</script>"
)


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium)"
)
def test_pages_render_in_headless_chromium(site, tmp_path):
    pages = ["index.html", "api/index.html", "api/core.html", "ARCHITECTURE.html"]
    pages += [f"auto_tutorials/{t}.html" for t in TUTORIALS]
    for i, rel in enumerate(pages):
        page = site / rel
        # a copy beside the page (its relative links still resolve) with a probe script
        probe = page.with_name(f"_probe_{page.name}")
        probe.write_text(
            page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"),
            encoding="utf-8",
        )
        proc = subprocess.run(
            [
                CHROMIUM,
                *BROWSER_FLAGS,
                f"--user-data-dir={tmp_path / f'p{i}'}",
                "--dump-dom",
                probe.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        probe.unlink()
        m = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
        assert m, f"{rel}: no probe result\n{proc.stderr[-2000:]}"
        r = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
        assert r["sheets"] >= 2, f"{rel}: the theme's stylesheets did not load ({r})"
        assert "serif" in r["font"] and r["font"] != "serif", f"{rel}: unstyled ({r['font']})"
        assert r["h1"].strip(), f"{rel}: no heading"
        assert all(s == "ok" for s in r["imgs"]), f"{rel}: pictures that did not load: {r['imgs']}"
        if rel.startswith("auto_tutorials/") and rel.split("/")[1][:-5] in (
            "tutorial_pictures",
            "tutorial_gradcam",
        ):
            assert len(r["imgs"]) >= 2, f"{rel}: its figures are missing"


# -- the API generator alone (fast): a package another branch adds appears without an edit ----------
def _generator():
    spec = importlib.util.spec_from_file_location(
        "hookscope_api", DOCS / "_ext" / "hookscope_api.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_api_groups_follow_the_packages_and_take_a_new_one(monkeypatch):
    gen = _generator()
    groups = {g.package: g for g in gen.collect()}
    # the packages docs/ARCHITECTURE.md names, in its order, core first
    assert list(groups)[:6] == ["core", "summarization", "cam", "monitor", "extraction", "viz"]
    assert ("autofunction", "hookscope.capture") in groups["core"].entries
    assert ("automodule", "hookscope.ops") in groups["core"].entries  # ops is core's public face
    assert ("autodata", "hookscope.Selector") in groups["core"].entries  # a typing alias
    assert ("autoclass", "hookscope.integrations.lightning.HookscopeCallback") in groups[
        "integrations"
    ].entries
    every = {t for g in groups.values() for _, t in g.entries}
    assert every >= {f"hookscope.{n}" for n in hookscope.__all__ if n != "ops"}

    # a new product package that the generator does not know: its own page, titled by its docstring
    pkg = types.ModuleType("hookscope.probing")
    pkg.__doc__ = "Probing: linear probes on activations.\n\nMore text."
    pkg.__path__ = []

    def probe(model):
        """Probe a model."""

    probe.__module__ = "hookscope.probing._probe"
    pkg.probe = probe
    pkg.__all__ = ["probe"]
    monkeypatch.setitem(sys.modules, "hookscope.probing", pkg)
    monkeypatch.setattr(hookscope, "probe", probe, raising=False)
    monkeypatch.setattr(hookscope, "__all__", [*hookscope.__all__, "probe"])
    groups = {g.package: g for g in gen.collect()}
    new = groups["probing"]
    assert new.entries == [("autofunction", "hookscope.probe")]
    assert new.lead == "Probing: linear probes on activations."
    order = list(groups)
    assert order.index("viz") < order.index("probing") < order.index("demo")
    page = gen._page(new)
    assert page.splitlines()[0] == "Probing (``hookscope.probing``)"
    assert ".. autofunction:: hookscope.probe" in page


@pytest.mark.slow
def test_a_tutorial_that_raises_fails_the_build_and_a_new_one_is_picked_up(tmp_path):
    """The site's gallery settings on a two-tutorial project: a new ``tutorial_*.py`` is run and
    listed with no other edit, and one that raises stops the build naming it."""
    src = tmp_path / "src"
    (src / "tutorials").mkdir(parents=True)
    shutil.copy(DOCS / "tutorials" / "GALLERY_HEADER.rst", src / "tutorials")
    (src / "conf.py").write_text(
        "import runpy\n"
        f"site = runpy.run_path({str(DOCS / 'conf.py')!r})\n"
        "extensions = ['sphinx_gallery.gen_gallery']\n"
        "sphinx_gallery_conf = site['sphinx_gallery_conf']\n"
        "suppress_warnings = site['suppress_warnings']\n"
        "exclude_patterns = site['exclude_patterns']\n"
    )
    (src / "index.rst").write_text("Site\n====\n\n.. toctree::\n\n   auto_tutorials/index\n")
    (src / "tutorials" / "tutorial_zzz_new.py").write_text(
        '"""\nA new tutorial\n==============\n\nAdded by another branch.\n"""\n\n# %%\nprint(6 * 7)\n'
    )
    (src / "tutorials" / "notes.py").write_text('"""\nNot a tutorial\n==============\n"""\n')

    def build() -> subprocess.CompletedProcess:
        env = dict(os.environ, MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        return subprocess.run(
            [*SPHINX, str(src), str(tmp_path / "html")],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )

    ok = build()
    assert ok.returncode == 0, ok.stderr[-3000:]
    page = (tmp_path / "html" / "auto_tutorials" / "tutorial_zzz_new.html").read_text()
    assert (
        "42" in page
        and "tutorial_zzz_new.html"
        in (tmp_path / "html" / "auto_tutorials" / "index.html").read_text()
    )
    assert not (tmp_path / "html" / "auto_tutorials" / "notes.html").exists()

    (src / "tutorials" / "tutorial_boom.py").write_text(
        '"""\nBoom\n====\n\nRaises.\n"""\n\n# %%\nraise ValueError("the tutorial is broken")\n'
    )
    failed = build()
    assert failed.returncode != 0
    assert "tutorial_boom.py" in failed.stderr and "the tutorial is broken" in failed.stderr
