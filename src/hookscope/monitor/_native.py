"""Optional native kernels: fused one-pass statistics of CPU tensors, for the training monitor.

The monitor's CPU statistics (sum, sum of squares, min, max and zero count of every activation;
sum of squares, min and max of every output gradient; min and max for the sentinel) are memory
passes. NumPy needs one per reduction; the C kernels in ``_fstats.c`` do all of a tensor's in
one. The file is compiled on first use with the system C compiler (``$CC``, else Python's, else
``cc``) into a per-user cache, keyed by the source, the compiler and the platform, and loaded
with :mod:`ctypes` (no Python API: any CPython can load it). On x86-64 with GCC the kernels are built for three instruction sets and the fastest one the
CPU has is picked at load time, so a cache shared by different machines is safe.

Nothing here is required. Without a compiler, when the build or the self-check fails, or with
``HOOKSCOPE_NATIVE=0`` in the environment, :func:`kernels` returns ``None`` and the monitor uses
NumPy, which gives the same values. ``HOOKSCOPE_CACHE`` sets the cache folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

__all__ = ["Kernels", "kernels"]

log = logging.getLogger("hookscope.native")

_SOURCE = Path(__file__).with_name("_fstats.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99"]
_P = ctypes.c_void_p


def _dense(a: np.ndarray) -> np.ndarray:
    """The kernels read ``a`` as one dense float32 run: refuse anything else (a strided view
    would make them read other memory)."""
    if a.dtype != np.float32 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(
            f"native kernels need a 1-D contiguous float32 array, got {a.dtype} "
            f"{a.shape} strides {a.strides}"
        )
    return a


class Kernels:
    """The loaded kernels. Arrays must be 1-D, C-contiguous float32 (else ValueError)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._stats = lib.hs_stats
        self._stats.argtypes = [_P, ctypes.c_int64, _P]
        self._stats.restype = None
        self._grad = lib.hs_grad_stats
        self._grad.argtypes = [_P, ctypes.c_int64, _P]
        self._grad.restype = None
        self._update = lib.hs_update_sumsq
        self._update.argtypes = [_P, _P, ctypes.c_int64, _P]
        self._update.restype = None

    def stats(self, a: np.ndarray) -> list[float]:
        """``[sum, sum of squares, min, max, zeros]`` of ``a`` in one read. ``min``/``max`` are
        only valid when the sum is finite (they skip NaN)."""
        out = (ctypes.c_double * 5)()
        self._stats(_dense(a).ctypes.data, a.shape[0], out)
        return list(out)

    def grad_stats(self, a: np.ndarray) -> list[float]:
        """``[sum of squares, min, max]`` of ``a`` in one read; ``min``/``max`` are only valid
        when the sum of squares is finite (they skip NaN)."""
        out = (ctypes.c_double * 3)()
        self._grad(_dense(a).ctypes.data, a.shape[0], out)
        return list(out)

    def update_sumsq(self, w: np.ndarray, b: np.ndarray) -> list[float]:
        """``[sum(w*w), sum(b*b), sum((w-b)**2)]``, each array read once (NaN/inf propagate)."""
        out = (ctypes.c_double * 3)()
        if w.shape != b.shape:
            raise ValueError(f"update_sumsq needs equal shapes, got {w.shape} and {b.shape}")
        self._update(_dense(w).ctypes.data, _dense(b).ctypes.data, w.shape[0], out)
        return list(out)


_lock = threading.Lock()
_loaded: list[Kernels | None] = []  # empty: not tried yet


def kernels() -> Kernels | None:
    """The native kernels, built and loaded on the first call; ``None`` when unavailable (the
    reason is logged at DEBUG level on logger ``hookscope.native``)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def reset() -> None:
    """Forget the loaded kernels, so that the next :func:`kernels` tries again (tests)."""
    with _lock:
        _loaded.clear()


def _load() -> Kernels | None:
    if os.environ.get("HOOKSCOPE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        log.debug("native kernels disabled by HOOKSCOPE_NATIVE")
        return None
    try:
        path = _build()
        k = Kernels(ctypes.CDLL(str(path)), path)
        _self_check(k)
        return k
    except Exception as e:  # no compiler, a failed build or load: NumPy gives the same values
        log.debug("native kernels unavailable: %s", e)
        return None


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cmd = shlex.split(cc)
    if not cmd or shutil.which(cmd[0]) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found)")
    return cmd


def _cache_dir() -> Path:
    env = os.environ.get("HOOKSCOPE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hookscope"


def _build() -> Path:
    cmd = _compiler()
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                " ".join(cmd + _FLAGS).encode(),
                platform.platform().encode(),
            ]
        )
    ).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"fstats-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes building at once never see a partial file
    fd, tmp = tempfile.mkstemp(prefix=path.stem + "-", suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        res = subprocess.run(
            [*cmd, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _self_check(k: Kernels) -> None:
    """Refuse kernels that disagree with NumPy on a small case (a miscompiled build)."""
    a = np.arange(-2500, 2600, dtype=np.float32) / 64
    a[7] = -0.0
    r = a[::-1].copy()  # each extreme once in the vector part, once in the tail
    d = a.astype(np.float64)
    sq = float((d * d).sum())
    ok = True
    for x in (a, r):
        s, q, mn, mx, z = k.stats(x)
        ok = ok and (mn, mx, z) == (float(a.min()), float(a.max()), 2.0)
        ok = ok and abs(s - d.sum()) <= 1e-6 * np.abs(d).sum() and abs(q - sq) <= 1e-6 * sq
        gq, gmn, gmx = k.grad_stats(x)
        ok = ok and (gmn, gmx) == (mn, mx) and abs(gq - sq) <= 1e-6 * sq
    w, b, u = k.update_sumsq(a, r)
    su = float(((d - r.astype(np.float64)) ** 2).sum())
    ok = ok and abs(w - sq) <= 1e-6 * sq and abs(b - sq) <= 1e-6 * sq and abs(u - su) <= 1e-6 * su
    if not ok:
        raise RuntimeError("native kernels disagree with NumPy; not used")
