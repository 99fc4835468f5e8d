"""Packed rows: several sequences laid end to end in each row of one row length.

`first_fit` is the one packing algorithm: polyexec's executor lays a packed call's sequences
out with it, and batch plans for packed rows count rows with it, so a plan's rows are exactly
the rows that run.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._checks import check_int, lengths_array

__all__ = ["Packing", "first_fit"]


class Packing(NamedTuple):
    """Where each sequence sits: row ``row[i]``, columns ``start[i] : start[i] + lengths[i]``
    of a ``(rows, row_length)`` grid."""

    row: np.ndarray      # int64, one per sequence
    start: np.ndarray    # int64, one per sequence
    rows: int
    row_length: int

    @property
    def cells(self) -> int:
        return self.rows * self.row_length


def first_fit(lengths, row_length: int) -> Packing:
    """First-fit decreasing: the longest sequence first, each into the first row with room.

    Deterministic (ties keep input order), so the same lengths always give the same layout.
    A sequence of length 0 takes no cells (row 0, start 0).

    >>> p = first_fit([5, 3, 8, 2], row_length=10)
    >>> p.rows, p.row.tolist(), p.start.tolist()
    (2, [1, 1, 0, 0], [0, 5, 0, 8])
    """
    arr = lengths_array(lengths, where="first_fit")
    row_length = check_int("first_fit", "row_length", row_length, minimum=1)
    if arr.size and int(arr.max()) > row_length:
        i = int(np.argmax(arr))
        raise ValueError(f"first_fit: lengths[{i}] = {int(arr[i])} is longer than row_length="
                         f"{row_length}")
    order = np.argsort(-arr, kind="stable")
    row = np.zeros(arr.size, np.int64)
    start = np.zeros(arr.size, np.int64)
    free: list[int] = []          # free cells left in each row so far
    for i in order:
        n = int(arr[i])
        if n == 0:
            continue
        for r, left in enumerate(free):
            if left >= n:
                break
        else:
            r = len(free)
            free.append(row_length)
        row[i], start[i] = r, row_length - free[r]
        free[r] -= n
    return Packing(row, start, len(free), row_length)
