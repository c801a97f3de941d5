"""Features out of a model: the :class:`FeatureExtractor` module and :func:`extract`, a whole data
set to memory-mapped files on disk (resumable, sharded across ranks)."""

from ._extract import extract
from ._extractor import FeatureExtractor
from ._featstore import ExtractError, Features, IncompleteExtractionError, load_features
from ._imagefolder import ImageFolder

__all__ = [
    "ExtractError",
    "FeatureExtractor",
    "Features",
    "ImageFolder",
    "IncompleteExtractionError",
    "extract",
    "load_features",
]
