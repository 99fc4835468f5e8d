"""What a policy does to a length distribution: padding, compiles, per-bucket table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._batching import batch_size_for, exact_sizes, global_steps
from ._checks import check_batching, lengths_array
from ._policies import BucketOverflowError, as_policy

__all__ = ["BucketRow", "Report", "report"]


@dataclass(frozen=True)
class BucketRow:
    """One bucket in use. ``padded_tokens`` counts elements after padding (real + padding).

    ``batch_size``/``batches`` are set when ``report`` got ``batch_size`` or ``max_tokens``
    (one shard, no dropping: ``batches = ceil(examples / batch_size)``).
    """

    size: int
    examples: int
    real_tokens: int
    padded_tokens: int
    efficiency: float
    batch_size: int | None = None
    batches: int | None = None


@dataclass(frozen=True)
class Report:
    """Padding and compile statistics of a policy on some lengths; ``str()`` is a table.

    ``padding_efficiency`` = real_tokens / padded_tokens. With a batch size (or token
    budget) ``padded_tokens`` counts the cells of the batches `batch_plan` makes -- the rows a
    partial batch is padded to included (``partial_rows``); without one, the length axis only.
    """

    policy: str
    examples: int
    real_tokens: int
    padded_tokens: int
    padding_efficiency: float
    expected_compiles: int  # buckets with at least one example: one compile each
    unused_buckets: int
    buckets: tuple[BucketRow, ...]

    def _rows(self) -> tuple[list[str], list[list[str]]]:
        batched = any(r.batch_size is not None for r in self.buckets)
        head = ["bucket", "examples", "real tokens", "padded tokens", "efficiency"]
        if batched:
            head += ["batch size", "batches"]
        rows = []
        for r in self.buckets:
            row = [str(r.size), str(r.examples), str(r.real_tokens), str(r.padded_tokens),
                   f"{r.efficiency:.3f}"]
            if batched:
                row += [str(r.batch_size), str(r.batches)]
            rows.append(row)
        total = ["total", str(self.examples), str(self.real_tokens), str(self.padded_tokens),
                 f"{self.padding_efficiency:.3f}"]
        if batched:
            total += ["", str(sum(r.batches for r in self.buckets))]
        rows.append(total)
        return head, rows

    def _title(self) -> str:
        return (f"{self.policy}: padding efficiency {self.padding_efficiency:.3f}, "
                f"{self.expected_compiles} compile{'s' if self.expected_compiles != 1 else ''}"
                + (f" ({self.unused_buckets} bucket{'s' if self.unused_buckets != 1 else ''} unused)"
                   if self.unused_buckets else ""))

    def to_table(self) -> str:
        """Plain-text table, one line per bucket in use plus a total line."""
        head, rows = self._rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
        rule = "  ".join("-" * w for w in widths)
        lines = [self._title(), fmt(head), rule, *(fmt(r) for r in rows[:-1]), rule, fmt(rows[-1])]
        return "\n".join(lines)

    __str__ = to_table

    def rich_table(self):
        """The same table as a ``rich.table.Table`` (rich is imported only here)."""
        from rich.table import Table

        head, rows = self._rows()
        table = Table(title=self._title())
        for h in head:
            table.add_column(h, justify="right")
        for r in rows[:-1]:
            table.add_row(*r)
        table.add_row(*rows[-1], style="bold", end_section=True)
        return table


def report(lengths, policy, *, batch_size: int | None = None, max_tokens: int | None = None,
           partial_rows=None) -> Report:
    """Padding efficiency, compiles and a per-bucket table for ``policy`` on ``lengths``.

    Lengths above the policy's largest bucket raise BucketOverflowError (cap or truncate
    them first, e.g. with ``buckets.corpus.lengths(..., cap=)``).

    >>> r = report([3, 4, 9, 16], [4, 16], batch_size=2)
    >>> r.padding_efficiency, r.expected_compiles
    (0.8, 2)
    >>> print(r)
    Fixed(sizes=(4, 16)): padding efficiency 0.800, 2 compiles
    bucket  examples  real tokens  padded tokens  efficiency  batch size  batches
    ------  --------  -----------  -------------  ----------  ----------  -------
         4         2            7              8       0.875           2        1
        16         2           25             32       0.781           2        1
    ------  --------  -----------  -------------  ----------  ----------  -------
     total         4           32             40       0.800                    2
    """
    where = "report"
    if batch_size is not None or max_tokens is not None:
        batch_size, max_tokens = check_batching(where, batch_size, max_tokens)
    arr = lengths_array(lengths, where=where)
    policy = as_policy(policy)
    sizes = np.asarray(policy.sizes, dtype=np.int64)
    over = np.flatnonzero(arr > sizes[-1])
    if over.size:
        raise BucketOverflowError(arr[over[0]], sizes[-1], index=over[0])
    which = np.searchsorted(sizes, arr, side="left")
    examples = np.bincount(which, minlength=sizes.size)
    real = np.bincount(which, weights=arr, minlength=sizes.size)
    batched = batch_size is not None or max_tokens is not None
    cells, steps = {}, {}
    if batched:
        for size, idx, r in global_steps(arr, policy, batch_size, max_tokens, False, 0, 0, False,
                                          1, "error", exact_sizes(where, policy, partial_rows)):
            cells[size] = cells.get(size, 0) + r * size
            steps[size] = steps.get(size, 0) + 1
    rows = []
    for k in np.flatnonzero(examples):
        size, n, rt = int(sizes[k]), int(examples[k]), int(real[k])
        b = None if not batched else (
            batch_size if batch_size is not None else batch_size_for(size, max_tokens))
        padded = cells[size] if batched else size * n
        rows.append(BucketRow(size=size, examples=n, real_tokens=rt, padded_tokens=padded,
                              efficiency=rt / padded, batch_size=b, batches=steps.get(size)))
    real_total = int(arr.sum())
    padded_total = sum(r.padded_tokens for r in rows)
    return Report(
        policy=repr(policy),
        examples=int(arr.size),
        real_tokens=real_total,
        padded_tokens=padded_total,
        padding_efficiency=real_total / padded_total,
        expected_compiles=len(rows),
        unused_buckets=int(sizes.size - len(rows)),
        buckets=tuple(rows),
    )
