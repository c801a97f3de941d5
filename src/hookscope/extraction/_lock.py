"""Who owns an output folder of :func:`hookscope.extract` while it runs: an ``flock`` on a lock file.

The lock is an ``fcntl.flock`` on ``out/.hookscope-extract.lock``, held by the process that writes
(rank 0 of a ``torch.distributed`` job, for the whole job: the other ranks write only between the
job's barriers, while rank 0 holds it). The kernel drops it when that process dies, SIGKILL
included, so a crashed run never leaves the folder stuck. The file holds the owner's pid, host and
start time (for the loser's message) and is deleted on release; since a waiter may have opened it
just before, an acquirer checks after locking that the file it locked is still the one at that
path (the usual unlink-safe protocol). A forked ``DataLoader`` worker inherits the locked
descriptor, which would keep the lock alive after its owner's death until the worker notices;
:class:`CloseInWorker` closes it in each worker first.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._featstore import ExtractError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK", "CloseInWorker", "OutputLock", "writer_of"]

LOCK = ".hookscope-extract.lock"


def _holder(path: Path) -> str:
    """Who holds the lock: its stamp, read again for up to 0.5 s while the owner (which locks
    first, then writes its stamp) has not written it yet."""
    text = ""
    for _ in range(10):
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text:
            return text
        time.sleep(0.05)
    return "another process (starting)"


class OutputLock:
    """Exclusive ownership of ``out`` for one extraction job; ``acquire`` fails at once if taken."""

    def __init__(self, out: Path) -> None:
        self.out, self.path = out, out / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None:  # pragma: no cover - no flock: no protection against a second writer
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise ExtractError(
                    f"{self.out} is being written by {_holder(self.path)}: two extractions cannot "
                    "share an output folder; wait for it to finish, or choose another --out/out"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the owner deleted it between our open and our lock: try again
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {stamp})\n".encode())
        self.fd = fd

    def worker_init(self, user: Callable[[int], Any] | None) -> Callable[[int], Any] | None:
        """A ``worker_init_fn`` that drops this lock's inherited descriptor, then calls ``user``."""
        if self.fd is None:
            return user
        st = os.fstat(self.fd)
        return CloseInWorker(self.fd, (st.st_dev, st.st_ino), user)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: see the module docstring
        finally:
            os.close(fd)


class CloseInWorker:
    """``worker_init_fn`` of the extraction's ``DataLoader``: closes the lock file's descriptor a
    forked worker inherited (only if that descriptor is still the lock file: a spawned worker has
    another file, or none, at that number), then runs the user's ``worker_init_fn``."""

    def __init__(self, fd: int, file: tuple[int, int], user: Callable[[int], Any] | None) -> None:
        self.fd, self.file, self.user = fd, file, user

    def __call__(self, worker_id: int) -> None:
        try:
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) == self.file:
                os.close(self.fd)
        except OSError:
            pass
        if self.user is not None:
            self.user(worker_id)


def writer_of(out: Path) -> str | None:
    """Who is writing ``out`` right now (the lock's holder), or ``None``."""
    path = out / LOCK
    if fcntl is None or not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _holder(path)
    finally:
        os.close(fd)  # closing drops a shared lock we may have taken
    return None
