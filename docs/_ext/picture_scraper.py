"""A sphinx-gallery image scraper for the pictures hookscope returns.

``hs.feature_maps`` and ``hs.plot_grad_flow`` return matplotlib figures that pyplot does not
manage, and ``hs.overlay`` returns a PIL image, so sphinx-gallery's matplotlib scraper would not
see them. This one shows, after each code cell, every figure or PIL image that a variable of the
tutorial holds and that no earlier cell showed. Figures that pyplot manages are left to the
matplotlib scraper (which runs after this one, see docs/conf.py) and remembered as shown, so that
no picture appears twice.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any


class PictureScraper:
    def __init__(self) -> None:
        self._seen: dict[str, set[int]] = {}

    def __repr__(self) -> str:  # sphinx-gallery keys its cache on the repr
        return "PictureScraper"

    def __call__(self, block: Any, block_vars: dict[str, Any], gallery_conf: dict) -> str:
        from matplotlib._pylab_helpers import Gcf
        from matplotlib.figure import Figure
        from PIL import Image
        from sphinx_gallery.scrapers import figure_rst

        seen = self._seen.setdefault(str(block_vars.get("src_file")), set())
        # pyplot's open figures: the matplotlib scraper saves (and closes) them after this one
        seen.update(id(m.canvas.figure) for m in Gcf.get_all_fig_managers())
        paths = []
        for value in list(block_vars["example_globals"].values()):
            items = value if isinstance(value, (list, tuple)) else [value]
            for obj in items:
                if not isinstance(obj, (Figure, Image.Image)) or id(obj) in seen:
                    continue
                seen.add(id(obj))
                path = PurePosixPath(next(block_vars["image_path_iterator"]))
                if isinstance(obj, Figure):
                    obj.savefig(path, bbox_inches="tight")
                else:
                    obj.convert("RGB").save(path)
                paths.append(path)
        return figure_rst(paths, gallery_conf["src_dir"])
