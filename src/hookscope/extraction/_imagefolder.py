"""``ImageFolder``: a folder of images as a map-style dataset that knows each sample's file path.

Unlike ``torchvision.datasets.ImageFolder`` it needs only Pillow, accepts a flat folder as well as
one sub-folder per class, and names the file in its errors, which :func:`hookscope.extract` uses
to report (or skip) an image that does not decode.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core._errors import HookscopeWarning, some_names

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder"]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"}
)
# PIL modes whose values go beyond 0..255: convert("RGB") clips them (16-bit 1000 -> 255, float
# 0.5 -> 0), so these are refused rather than read as a white (or black) picture
_WIDE_MODES = {
    "I;16": "16-bit",
    "I;16L": "16-bit",
    "I;16B": "16-bit",
    "I;16N": "16-bit",
    "I": "32-bit integer",
    "F": "32-bit float",
}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageFolder(torch.utils.data.Dataset):
    """Every image file under ``root`` (recursively, sorted by relative path), as ``(image, label)``.

    Files are chosen by extension (``extensions``, any case); symbolic links to folders are
    followed (each real folder once), a link to a missing file is kept and fails to load naming
    itself. ``label`` is the index of the first-level sub-folder among all of them (sorted, as
    torchvision's ``ImageFolder``: a folder with no image keeps its label and is warned of), or 0
    for files directly in ``root`` (warned of when class folders exist, whose first has label 0 too);
    images in hidden folders (``.ipynb_checkpoints``) are samples too, as torchvision reads them,
    with a warning naming the folders. Without ``transform`` an image becomes a float tensor ``(3, S, S)``: its shorter side
    resized to ``round(S / 0.875)`` (bilinear), centre-cropped to ``S = image_size`` and normalised
    with the ImageNet mean and std, as the torchvision classification weights expect (equal to
    ``Compose([Resize(round(S / 0.875)), CenterCrop(S), ToTensor(), Normalize(mean, std)])``). With
    ``image_size=None`` the image keeps its size. ``transform(pil_image)`` replaces all of this.

    ``sample_id(i)`` is the file's path relative to ``root`` (the ``index`` that
    :func:`hookscope.extract` saves). A file that does not decode raises an ``OSError`` naming it,
    and so does a 16-bit, 32-bit integer or float image (PIL modes ``I;16``, ``I``, ``F``), which
    ``convert("RGB")`` would clip to 0..255. Every other mode is read as PIL's ``convert("RGB")``
    reads it (torchvision's loader): grayscale repeated in three channels, the alpha of RGBA, LA
    and palette images dropped (transparent pixels keep their stored colour), CMYK converted by
    PIL, the first frame of an animated GIF; the EXIF orientation is *not* applied (pass
    ``transform=lambda im: f(PIL.ImageOps.exif_transpose(im))`` for photos that need it).

    Example:
        >>> import tempfile, numpy as np
        >>> from PIL import Image
        >>> root = tempfile.mkdtemp()
        >>> Image.fromarray(np.zeros((40, 50, 3), np.uint8)).save(f"{root}/a.png")
        >>> ds = ImageFolder(root, image_size=32)
        >>> len(ds), ds.sample_id(0), tuple(ds[0][0].shape)
        (1, 'a.png', (3, 32, 32))
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        image_size: int | None = 224,
        transform: Callable[[Any], Any] | None = None,
        extensions: frozenset[str] | set[str] = IMAGE_EXTENSIONS,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"image folder {str(root)!r} does not exist or is not a directory"
            )
        exts = {e.lower() for e in extensions}
        files = sorted(_image_files(self.root, exts))
        if not files:
            raise FileNotFoundError(
                f"no image files ({', '.join(sorted(exts))}) under {str(root)!r}"
            )
        # every first-level folder is a class, as torchvision's find_classes has it, so the labels
        # are torchvision's; one holding no image is said, not dropped (which shifted the labels)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        used = {f.split("/", 1)[0] for f in files if "/" in f}
        empty = [c for c in self.classes if c not in used]
        if empty:
            warnings.warn(
                f"ImageFolder {str(root)!r}: the class folder(s) {some_names(empty)} hold no "
                f"image ({', '.join(sorted(exts))}); they keep their label (as torchvision's "
                "ImageFolder counts them), so no sample has it",
                HookscopeWarning,
                stacklevel=2,
            )
        # hidden folders (a notebook's .ipynb_checkpoints, a .git): torchvision counts them too,
        # so their images are samples like any other; said, labels kept as torchvision's
        hidden = sorted(
            {
                "/".join(f.split("/")[: k + 1])
                for f in files
                for k, part in enumerate(f.split("/")[:-1])
                if part.startswith(".")
            }
        )
        if hidden:
            n = sum(1 for f in files if any(p.startswith(".") for p in f.split("/")[:-1]))
            warnings.warn(
                f"ImageFolder {str(root)!r}: {n} image(s) lie in hidden folder(s) "
                f"{some_names(hidden)} (a notebook's .ipynb_checkpoints, a .git); they are "
                "samples like any other (a hidden first-level folder is a class, as torchvision's "
                "ImageFolder counts it); move those folders out of the data folder",
                HookscopeWarning,
                stacklevel=2,
            )
        top = [f for f in files if "/" not in f]
        if top and self.classes:
            warnings.warn(
                f"ImageFolder {str(root)!r}: {len(top)} image(s) lie directly in the folder "
                f"({some_names(top)}) beside the class folders; they get label 0, which is also "
                f"class {self.classes[0]!r}'s: move them into a folder of their own to tell them "
                "apart",
                HookscopeWarning,
                stacklevel=2,
            )
        cls_index = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = [
            (str(self.root / f), cls_index[f.split("/", 1)[0]] if "/" in f else 0) for f in files
        ]
        self.files = files
        self.image_size = image_size
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def sample_id(self, i: int) -> str:
        """The path of sample ``i`` relative to ``root``."""
        return self.files[i]

    def load(self, i: int) -> Any:
        """Sample ``i`` as an RGB ``PIL.Image`` (decoded fully, so a truncated file fails here, even
        when ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set)."""
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - pillow is an optional dependency
            raise ImportError(
                "reading image folders needs Pillow: pip install 'hookscope[viz]'"
            ) from None
        path = self.samples[i][0]
        try:
            with _strict_decoding(), Image.open(path) as im:
                mode = im.mode
                if mode not in _WIDE_MODES:
                    return im.convert("RGB")
        except Exception as e:
            raise OSError(f"cannot decode image {path}: {type(e).__name__}: {e}") from e
        raise OSError(
            f"cannot read image {path}: it is a {_WIDE_MODES[mode]} image (PIL mode {mode!r}), and "
            "PIL's convert('RGB') clips its values to 0..255 (a 16-bit 1000 becomes 255); convert "
            "the file to 8 bits with the scaling it needs (e.g. values / 257 for the full 16-bit "
            "range), or give extract a Dataset of your own that reads it"
        )

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image = self.load(i)
        label = self.samples[i][1]
        if self.transform is not None:
            return self.transform(image), label
        return to_tensor(image, self.image_size), label

    def __repr__(self) -> str:
        return f"ImageFolder({str(self.root)!r}, {len(self)} images, {len(self.classes)} classes, image_size={self.image_size})"


_STRICT = threading.Lock()


@contextlib.contextmanager
def _strict_decoding() -> Iterator[None]:
    """PIL's ``ImageFile.LOAD_TRUNCATED_IMAGES`` off while an image decodes (put back after): with
    it on (a library or script may set it), a truncated file decodes with its missing part grey,
    silently, where the docstring promises an error naming the file."""
    from PIL import ImageFile

    if not ImageFile.LOAD_TRUNCATED_IMAGES:
        yield
        return
    with _STRICT:
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        try:
            yield
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = True


def _image_files(root: Path, exts: set[str]) -> list[str]:
    """Paths (relative, POSIX) of the files under ``root`` with an extension in ``exts``, following
    symbolic links to folders (as ``os.walk(followlinks=True)`` in torchvision's ImageFolder; each
    real folder once, so a link cycle ends) and keeping a link to a missing file, which then fails
    to load naming itself rather than vanishing."""
    out: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        rel = Path(dirpath).relative_to(root)
        out.extend(
            (rel / f).as_posix() for f in filenames if os.path.splitext(f)[1].lower() in exts
        )
    return out


def to_tensor(image: Any, size: int | None) -> torch.Tensor:
    """Resize (shorter side to ``round(size / 0.875)``), centre-crop ``size``, scale to [0, 1],
    normalise: torchvision's ``Resize``, ``CenterCrop``, ``ToTensor`` and ``Normalize``."""
    from PIL import Image

    if size is not None:
        # torchvision's Resize(short) and CenterCrop(size), to the pixel: the longer side is
        # truncated (int), the crop's offsets rounded (Python's round), as torchvision computes them
        w, h = image.size
        short = round(size / 0.875)
        if w <= h:
            nw, nh = short, int(short * h / w)
        else:
            nw, nh = int(short * w / h), short
        image = image.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = round((nw - size) / 2.0), round((nh - size) / 2.0)
        image = image.crop((left, top, left + size, top + size))
    arr = np.asarray(image, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
