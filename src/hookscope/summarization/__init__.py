"""The model summary: one row per module call with shapes, parameters, FLOPs, time and memory."""

from ._summary import Summary, SummaryRow, SummaryTotals, summary

__all__ = ["Summary", "SummaryRow", "SummaryTotals", "summary"]
