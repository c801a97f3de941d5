"""Sphinx configuration of hookscope's site: ``make docs`` builds it into docs/_build/html.

Pages: the guides (Markdown, myst-parser), the tutorials (every ``tutorials/tutorial_*.py``,
executed by sphinx-gallery during the build), the API reference (generated from
``hookscope.__all__`` by ``_ext/hookscope_api.py``) and docs/ARCHITECTURE.md for contributors.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's hookscope, not an installed one

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import hookscope  # noqa: E402

project = "hookscope"
author = "hookscope contributors"
copyright = "hookscope contributors"
release = version = hookscope.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "hookscope_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tutorials/GALLERY_HEADER.rst", "**/sg_execution_times.rst"]
suppress_warnings = ["config.cache"]  # sphinx-gallery's sort key is a class (not picklable)

html_theme = "furo"
html_title = f"hookscope {release}"
html_static_path: list[str] = []

# the API reference: the names as users write them (hookscope.capture), signatures with hints
add_module_names = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: no clash with documented properties

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

from picture_scraper import PictureScraper  # noqa: E402
from tutorial_order import TutorialOrder  # noqa: E402

sphinx_gallery_conf = {
    "examples_dirs": "tutorials",
    "gallery_dirs": "auto_tutorials",
    "filename_pattern": r"/tutorial_",  # execute every tutorial_*.py
    "ignore_pattern": r"^(?!.*tutorial_)",  # and collect nothing else
    "within_subsection_order": TutorialOrder,
    "abort_on_example_error": True,  # a tutorial that raises stops the build
    "only_warn_on_example_error": False,
    "plot_gallery": "True",
    "download_all_examples": False,
    # PictureScraper first: it leaves pyplot's figures to the matplotlib scraper (each shown once)
    "image_scrapers": (PictureScraper(), "matplotlib"),
    "matplotlib_animations": False,
    "capture_repr": ("_repr_html_", "__repr__"),
    "remove_config_comments": True,
    "show_memory": False,
    "min_reported_time": 0,
    "write_computation_times": True,
    "reset_modules": ("matplotlib",),
}

# a tutorial's own warnings print in its output; Python's defaults would hide repeated ones
warnings.filterwarnings("default", category=UserWarning)
