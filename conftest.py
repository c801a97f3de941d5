"""pytest runs the docstrings' examples of src/hookscope as doctests (``--doctest-modules`` in
pyproject.toml). An integration module imports its host framework when imported, so one whose
framework is not installed is left out of that collection instead of failing it (``make test``
installs every extra, so there nothing is left out)."""

from __future__ import annotations

import importlib.util

# integration module -> the package it imports
_HOSTS = {"lightning": "lightning", "transformers": "transformers"}

collect_ignore = [
    f"src/hookscope/integrations/{module}.py"
    for module, host in _HOSTS.items()
    if importlib.util.find_spec(host) is None
]
