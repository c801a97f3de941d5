"""``hookscope demo`` / ``hookscope report``: a self-contained HTML report whose every picture
decodes, that headless Chromium renders, and that escapes every piece of text it shows."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import hookscope as hs
from hookscope.cli import main
from hookscope.demo._html import Figure, Report

CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)
SECTIONS = ["Summary", "Feature maps", "Grad-CAM", "Gradient flow", "NaN origin"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict[str, str | None]]]:
    p = _Tags()
    p.feed(page)
    return p.tags


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def check_self_contained(page: str) -> list[Image.Image]:
    """Every <img> is an inline PNG that decodes; nothing refers to anything outside the page."""
    tags = _tags(page)
    assert not any(t in ("script", "link", "iframe", "object", "embed") for t, _ in tags)
    assert "url(" not in page and "@import" not in page
    images = []
    for tag, attrs in tags:
        for key in ("src", "href"):
            v = attrs.get(key)
            if v is not None:
                assert v.startswith(("data:image/png;base64,", "#")), (
                    f"<{tag} {key}={v[:40]!r}> is not inline"
                )
        if tag == "img":
            data = base64.b64decode(attrs["src"].split(",", 1)[1], validate=True)
            im = Image.open(io.BytesIO(data))
            im.load()  # decodes every pixel; raises on a broken PNG
            assert im.format == "PNG" and im.size == (int(attrs["data-w"]), int(attrs["data-h"]))
            assert np.asarray(im.convert("L")).std() > 1.0, "a blank picture"
            images.append(im)
    return images


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    rc, stdout, stderr = _run(["demo", "--out", str(out), "--images", "6", "--steps", "4"])
    return rc, stdout, stderr, out / "report.html"


def test_demo_writes_a_report_and_prints_a_summary(demo):
    rc, stdout, stderr, path = demo
    assert rc == 0, stderr
    assert path.is_file()
    assert f"report: {path.resolve()}" in stdout
    assert "not available" not in stdout
    assert re.search(r"test images classified right: \d/6", stdout)
    assert (
        "NaN origin: NAN first produced in the forward pass by layer 'stage2.4' (BatchNorm2d)"
        in stdout
    )
    page = path.read_text(encoding="utf-8")
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    assert "not available" not in page
    images = check_self_contained(page)
    # input + 3 stage grids, 6 CAM overlays, the gradient-flow plot
    assert len(images) == 1 + 3 + 6 + 1
    for cls in ("circle", "square", "triangle", "cross"):
        assert cls in page
    assert "stage2.4" in page and "BatchNorm2d" in page


def test_demo_report_numbers_match_the_model(demo):
    # the KPI "k/6 test images classified right" equals the model's own predictions
    _, stdout, _, _ = demo
    from hookscope.demo._model import TEST_SEED

    ds = hs.make_demo_dataset(6, seed=TEST_SEED + 1)
    with torch.no_grad():
        right = int((hs.load_demo_model()(ds.images).argmax(1) == ds.labels).sum())
    assert f"test images classified right: {right}/6" in stdout


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium)"
)
def test_report_renders_in_headless_chromium(demo, tmp_path):
    _, _, _, path = demo
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--run-all-compositor-stages-before-draw",
        "--window-size=1200,3000",
    ]
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            CHROMIUM,
            *flags,
            f"--user-data-dir={tmp_path / 'p1'}",
            f"--screenshot={shot}",
            path.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert shot.is_file(), proc.stderr[-2000:]
    with Image.open(shot) as im:
        im.load()
        assert im.format == "PNG" and im.size == (1200, 3000)
        px = np.asarray(im.convert("RGB")).astype(np.float32)
    assert px.std() > 20, "the screenshot is blank"
    assert len(np.unique(px.reshape(-1, 3)[::7], axis=0)) > 500  # pictures rendered, not just text
    # the page header's dark-blue banner is at the top
    assert px[:40, :, 2].mean() > px[:40, :, 0].mean() + 30

    # in the browser, every image loaded (naturalWidth > 0) at its recorded size: a copy of the
    # report with a tiny check script, whose result --dump-dom prints
    page = path.read_text(encoding="utf-8")
    check = (
        "<script>addEventListener('load',()=>{const r=[...document.images].map(i=>i.complete&&i.naturalWidth>0"
        "?i.naturalWidth+'x'+i.naturalHeight:'BROKEN');const p=document.createElement('pre');p.id='imgcheck';"
        "p.textContent=JSON.stringify(r);document.body.appendChild(p);});</script>"
    )
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", check + "</body>"), encoding="utf-8")
    proc = subprocess.run(
        [
            CHROMIUM,
            *flags,
            f"--user-data-dir={tmp_path / 'p2'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probe.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    m = re.search(r'<pre id="imgcheck">(.*?)</pre>', proc.stdout)
    assert m, proc.stderr[-2000:]
    loaded = json.loads(m.group(1).replace("&quot;", '"'))
    expected = [f"{a['data-w']}x{a['data-h']}" for t, a in _tags(page) if t == "img"]
    assert loaded == expected


def _save_png(t: torch.Tensor, path: Path) -> Path:
    Image.fromarray((t.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(path)
    return path


def test_report_on_the_demo_model_with_one_image(tmp_path):
    ds = hs.make_demo_dataset(1, seed=123)
    img = _save_png(ds.images[0], tmp_path / "shape.png")
    rc, stdout, stderr = _run(["report", "demo", "--image", str(img), "--out", str(tmp_path / "r")])
    assert rc == 0, stderr
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    check_self_contained(page)
    with torch.no_grad():
        pred = int(hs.load_demo_model()(ds.images[:1]).argmax(1))
    assert f"predicted {ds.classes[pred]} (" in page
    assert "Grad-CAM layer: stage3" in stdout and f"prediction: {ds.classes[pred]} (" in stdout
    assert "omitted: it needs a training loop" in page
    assert "every activation and gradient stayed finite" in page


MODEL_FILE = """
import torch.nn as nn

class Net(nn.Module):
    classes = ("<b>cat</b>", "dog & co")

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1))
        self.act = nn.ReLU(inplace=True)  # modifies the output of `features` in place
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.pool(self.act(self.features(x))).flatten(1))
"""


def test_report_on_a_user_model_escapes_text_and_omits_what_does_not_apply(tmp_path):
    (tmp_path / "net.py").write_text(MODEL_FILE)
    rng = np.random.default_rng(0)
    img = tmp_path / "x.png"
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(img)
    torch.manual_seed(0)
    rc, stdout, stderr = _run(
        [
            "report",
            f"{tmp_path / 'net.py'}:Net",
            "--image",
            str(img),
            "--out",
            str(tmp_path / "r"),
            "--resize",
            "24",
            "--crop",
            "24",
            "--mean",
            "0.5",
            "--std",
            "0.5",
        ]
    )
    assert rc == 0, stderr
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    check_self_contained(page)
    assert "<b>cat</b>" not in page and ("&lt;b&gt;cat&lt;/b&gt;" in page or "dog &amp; co" in page)
    assert "Grad-CAM layer: act" in stdout  # the last top-level layer with a (B, C, H, W) output
    assert "omitted: it needs a training loop" in page
    assert "not available" not in page and "InPlaceModified" not in stdout + stderr
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page


def test_cli_errors_are_one_line_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _run(["demo", "--out", str(f)])
    assert rc == 2 and "is a file" in err and err.count("\n") == 1
    rc, _, err = _run(
        ["report", "demo", "--image", str(tmp_path / "missing.png"), "--out", str(tmp_path / "r")]
    )
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1
    img = _save_png(hs.make_demo_dataset(1).images[0], tmp_path / "s.png")
    rc, _, err = _run(
        ["report", "demo", "--image", str(img), "--layer", "stage9", "--out", str(tmp_path / "r")]
    )
    assert rc == 2 and "stage3" in err and err.count("\n") == 1  # the closest valid names
    assert not (tmp_path / "r" / "report.html").exists()


def test_report_template_escapes_everything():
    r = Report("<script>alert(1)</script>", subtitle="a & b")
    r.kpi("<1>", "<label>")
    s = r.section("T<i>tle", "intro <b>", note="note <u>")
    s.text("text <p>").text("code <x>", kind="code").table(["<h>"], [["<c>", 1]])
    picture = np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5
    s.figures([Figure(picture, "cap <tion>", tone="bad")])
    page = r.to_html()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for raw in (
        "<1>",
        "<label>",
        "T<i>tle",
        "intro <b>",
        "note <u>",
        "text <p>",
        "code <x>",
        "<h>",
        "<c>",
        "cap <tion>",
    ):
        assert raw not in page
    (im,) = check_self_contained(page)
    assert np.array_equal(np.asarray(im), picture)


@pytest.mark.slow
def test_hookscope_demo_console_script_with_defaults(tmp_path):
    """What `make demo` runs (8 images, 20 monitored steps), as a separate process."""
    exe = Path(sys.executable).with_name("hookscope")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "hookscope"]
    proc = subprocess.run(
        [*cmd, "demo", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "report:" in proc.stdout and "not available" not in proc.stdout
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert len(check_self_contained(page)) == 1 + 3 + 8 + 1
