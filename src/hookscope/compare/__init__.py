"""Numerics diff: ``hs.compare`` names the module whose own computation makes run B differ from
run A (forward and backward, across dtypes and compilation); ``hs.record`` writes a run to disk
to compare it from another process."""

from ._compare import compare
from ._record import Record, record
from ._report import CompareReport, CompareRow
from ._run import CompareError

__all__ = ["CompareError", "CompareReport", "CompareRow", "Record", "compare", "record"]
