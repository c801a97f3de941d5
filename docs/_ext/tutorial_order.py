"""The order of the tutorials: a reader's path through the features, then any new tutorial
(``tutorial_<topic>.py`` added by another feature) in alphabetical order."""

from __future__ import annotations

import os

FIRST = [
    "tutorial_shapes.py",
    "tutorial_features.py",
    "tutorial_pictures.py",
    "tutorial_edit.py",
    "tutorial_training.py",
    "tutorial_gradcam.py",
    "tutorial_compiled.py",
]


class TutorialOrder:
    """sphinx-gallery's ``within_subsection_order``: a sort key over file names."""

    def __init__(self, src_dir: str) -> None:
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        name = os.path.basename(filename)
        return (FIRST.index(name), name) if name in FIRST else (len(FIRST), name)

    def __repr__(self) -> str:
        return "TutorialOrder"
