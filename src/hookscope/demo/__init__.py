"""The built-in demo: a small trained CNN, its procedural data set, and the HTML report."""

from ._data import DemoDataset, make_demo_dataset
from ._model import DemoNet, load_demo_model

__all__ = ["DemoDataset", "DemoNet", "load_demo_model", "make_demo_dataset"]
