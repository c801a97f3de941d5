"""The pinned requirement sets agree: ``make demo`` installs requirements-demo.txt and ``make
test`` requirements-dev.txt into the same ``.venv``, so a package pinned in both must have one
version, and the dev set must hold all of the demo set (else ``make test`` after ``make demo``
would keep a demo-only pin)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pkg, _, version = line.partition("==")
            assert version, f"{name}: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", pkg).lower()] = version
    return pins


def test_demo_pins_are_dev_pins():
    demo, dev = _pins("requirements-demo.txt"), _pins("requirements-dev.txt")
    assert {"torch", "torchvision", "matplotlib", "rich", "numpy", "tqdm"} <= set(demo)
    assert {k: v for k, v in demo.items() if dev.get(k) != v} == {}
    assert demo["torch"] == "2.14.1" and demo["torchvision"] == "0.29.1"
