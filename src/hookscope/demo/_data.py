"""The demo data set: 64×64 RGB pictures of one shape on a noisy background, drawn from a seed.

Each picture holds one circle, square, triangle or cross at a random position, size, rotation and
colour, on a background with a random colour, a brightness ramp, pixel noise and a few small
distractor dots. The exact bounding box of the shape's pixels is recorded, so an explanation
method can be checked against where the shape really is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DEMO_CLASSES", "IMAGE_SIZE", "DemoDataset", "make_demo_dataset"]

#: Class names of the demo data set, in label order.
DEMO_CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
#: Height and width of every demo image.
IMAGE_SIZE = 64

_RADIUS = (9.0, 18.0)  # circumradius of a shape, in pixels
_MIN_CONTRAST = 0.45  # Euclidean RGB distance between the shape and the background colour


@dataclass(frozen=True)
class DemoDataset(torch.utils.data.Dataset):
    """Images, labels and bounding boxes of the demo data set (all tensors on the CPU).

    Attributes:
        images: ``(N, 3, 64, 64)`` float32 in [0, 1].
        labels: ``(N,)`` int64 class indices into :attr:`classes`.
        boxes: ``(N, 4)`` int64 ``(x0, y0, x1, y1)``, inclusive pixel coordinates of the shape.
        classes: the class names.
        seed: the seed it was drawn from.

    Indexing gives ``(image, label)`` so it plugs into a ``DataLoader``.
    """

    images: torch.Tensor
    labels: torch.Tensor
    boxes: torch.Tensor
    classes: tuple[str, ...]
    seed: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(len(self)))


def _shape_mask(kind: int, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Boolean ``(64, 64)`` mask of one shape (pixel centres tested against its outline)."""
    coords = np.arange(IMAGE_SIZE, dtype=np.float64) + 0.5
    x, y = np.meshgrid(coords, coords)  # x varies along columns, y along rows
    c, s = np.cos(angle), np.sin(angle)
    u = c * (x - cx) + s * (y - cy)
    v = -s * (x - cx) + c * (y - cy)
    if kind == 0:  # circle
        return u * u + v * v <= (0.8 * r) ** 2
    if kind == 1:  # square
        a = 0.7 * r
        return (np.abs(u) <= a) & (np.abs(v) <= a)
    if kind == 2:  # equilateral triangle with circumradius r
        root3 = np.sqrt(3.0)
        return (v >= -r / 2) & (v <= r - root3 * u) & (v <= r + root3 * u)
    if kind == 3:  # cross (plus sign)
        long, short = 0.85 * r, 0.28 * r
        return ((np.abs(u) <= long) & (np.abs(v) <= short)) | (
            (np.abs(u) <= short) & (np.abs(v) <= long)
        )
    raise ValueError(f"unknown shape kind {kind}; expected 0..{len(DEMO_CLASSES) - 1}")


def _draw(rng: np.random.Generator, kind: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    n = IMAGE_SIZE
    coords = np.arange(n, dtype=np.float64) + 0.5
    x, y = np.meshgrid(coords, coords)
    bg = rng.uniform(0.0, 1.0, size=3)
    while True:
        fg = rng.uniform(0.0, 1.0, size=3)
        if np.linalg.norm(fg - bg) >= _MIN_CONTRAST:
            break
    phi = rng.uniform(0, 2 * np.pi)
    ramp = rng.uniform(-0.15, 0.15) * ((x * np.cos(phi) + y * np.sin(phi)) / n - 0.5)
    img = np.broadcast_to(bg[:, None, None], (3, n, n)) + ramp[None]
    for _ in range(rng.integers(0, 4)):  # small distractor dots, well below any shape's size
        dx, dy, dr = rng.uniform(2, n - 2), rng.uniform(2, n - 2), rng.uniform(1.0, 2.5)
        dot = (x - dx) ** 2 + (y - dy) ** 2 <= dr * dr
        img = np.where(dot[None], rng.uniform(0.0, 1.0, size=3)[:, None, None], img)
    r = rng.uniform(*_RADIUS)
    cx, cy = rng.uniform(r + 1, n - r - 1, size=2)
    mask = _shape_mask(kind, cx, cy, r, rng.uniform(0, 2 * np.pi))
    img = np.where(mask[None], fg[:, None, None], img)
    img = img + rng.normal(0.0, rng.uniform(0.02, 0.08), size=img.shape)
    ys, xs = np.nonzero(mask)
    box = (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max()))
    return np.clip(img, 0.0, 1.0).astype(np.float32), box


def make_demo_dataset(n: int, *, seed: int = 0) -> DemoDataset:
    """Draw ``n`` demo images (classes balanced, in shuffled order); the same seed gives the same data.

    Args:
        n: number of images.
        seed: any non-negative integer; different seeds give independent data sets.

    Example:
        >>> import hookscope as hs
        >>> ds = hs.make_demo_dataset(8, seed=1)
        >>> ds.images.shape, ds.classes[int(ds.labels[0])] in ds.classes
        (torch.Size([8, 3, 64, 64]), True)
        >>> x0, y0, x1, y1 = ds.boxes[0].tolist(); 0 <= x0 < x1 < 64 and 0 <= y0 < y1 < 64
        True
        >>> bool((hs.make_demo_dataset(8, seed=1).images == ds.images).all())
        True
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x686F6F6B]))
    k = len(DEMO_CLASSES)
    labels = rng.permutation(np.arange(n) % k) if n else np.zeros(0, dtype=np.int64)
    images = np.empty((n, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    boxes = np.empty((n, 4), dtype=np.int64)
    for i, kind in enumerate(labels):
        images[i], boxes[i] = _draw(rng, int(kind))
    return DemoDataset(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels.astype(np.int64)),
        boxes=torch.from_numpy(boxes),
        classes=DEMO_CLASSES,
        seed=seed,
    )
