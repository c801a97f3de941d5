"""The built-in demos: a small trained CNN and its procedural data set, the HTML report, and a
tiny trained language model with induction heads and its prompts."""

from ._data import DemoDataset, make_demo_dataset
from ._lm import InductionPrompts, load_demo_lm, make_induction_prompts, train_demo_lm
from ._model import DemoNet, load_demo_model

__all__ = [
    "DemoDataset",
    "DemoNet",
    "InductionPrompts",
    "load_demo_lm",
    "load_demo_model",
    "make_demo_dataset",
    "make_induction_prompts",
    "train_demo_lm",
]
