"""Packed rows: several sequences laid end to end in each row of one row length.

`first_fit` counts rows: batch plans for packed rows (`packed_batch_plan`) and polyexec's
executor both count a step's rows with it, so a plan's rows are exactly the rows that run.
`balanced_fit` then lays the sequences out over those rows, the longest row as short as it
can make it: a scan over packed rows stops at the batch's last real column. `packed_cells`
prices a plan's padded cells.
"""

from __future__ import annotations

import functools
import heapq
import typing
from collections.abc import Mapping
from typing import Iterator, Literal, NamedTuple

import numpy as np

from ._checks import check_bool, check_epoch_shard, check_int, check_option, lengths_array
from ._policies import BucketOverflowError, as_policy

__all__ = ["PackedBatch", "PackedOverflow", "Packing", "balanced_fit", "first_fit",
           "joint_first_fit", "packed_batch_plan", "packed_batches", "packed_cells"]

PackedOverflow = Literal["error", "truncate"]
_PACKED_OVERFLOW_OPTIONS: tuple[str, ...] = typing.get_args(PackedOverflow)


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


def balanced_fit(lengths, row_length: int, rows: int, *, first: Packing | None = None
                 ) -> Packing:
    """The sequences over ``rows`` rows of ``row_length`` with the fullest row as empty as a
    greedy spread makes it: longest first, each into the emptiest row (ties: the lowest row).

    A scan over packed rows runs up to the last real column of the whole grid, so a batch
    spread evenly stops early where `first_fit`, filling rows one after the other, runs to
    the end. When the spread does not fit, or its fullest row is not shorter than
    first-fit's, this is ``first_fit(lengths, row_length)`` (whose ``rows`` may be fewer).
    ValueError when first-fit needs more than ``rows`` rows. ``first``: that first-fit
    layout, when the caller has it already (it counted the rows with it).

    >>> first_fit([5, 3, 8, 2], row_length=10).start.tolist()    # rows filled 10 and 8
    [0, 5, 0, 8]
    >>> p = balanced_fit([5, 3, 8, 2], row_length=10, rows=3)    # 8, 5 and 5: stop at 8
    >>> p.rows, p.row.tolist(), p.start.tolist()
    (3, [1, 2, 0, 2], [0, 0, 0, 3])
    """
    where = "balanced_fit"
    arr = lengths_array(lengths, where=where)
    rows = check_int(where, "rows", rows, minimum=1)
    packed = first if first is not None else first_fit(arr, row_length)
    if packed.rows > rows:
        raise ValueError(f"{where}: the sequences need {packed.rows} rows of {row_length} "
                         f"(first_fit), more than rows={rows}")
    fullest = int((packed.start + arr).max(initial=0))
    order = np.argsort(-arr, kind="stable")
    row = np.zeros(arr.size, np.int64)
    start = np.zeros(arr.size, np.int64)
    fill = [(0, r) for r in range(rows)]          # a heap of (cells filled, row)
    for i in order:
        n = int(arr[i])
        if n == 0:
            continue
        used, r = heapq.heappop(fill)
        if used + n > packed.row_length:
            return packed
        row[i], start[i] = r, used
        heapq.heappush(fill, (used + n, r))
    return Packing(row, start, rows, packed.row_length) if max(fill)[0] < fullest else packed


# --------------------------------------------------------------------------- batch plans


def joint_first_fit(cells: Mapping[str, np.ndarray], widths: Mapping[str, int]
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """``(row, {variable: start}, rows)``: first-fit of examples that take ``cells[v][i]``
    cells in rows ``widths[v]`` wide of each variable ``v``, an example's parts in the same
    row of every variable's grid, the biggest examples first (by their largest share of a
    row); an example of no cells takes none (row 0, start 0).

    >>> row, start, rows = joint_first_fit({"S": np.array([3, 1, 2]), "T": np.array([1, 4, 2])},
    ...                                    {"S": 4, "T": 5})
    >>> rows, row.tolist(), start["S"].tolist(), start["T"].tolist()
    (2, [0, 0, 1], [1, 0, 0], [4, 0, 0])
    """
    names = list(cells)
    need = np.stack([np.asarray(cells[v], np.int64) for v in names], axis=1)
    width = np.array([widths[v] for v in names], np.int64)
    order = np.argsort(-(need / width).max(axis=1, initial=0), kind="stable")
    row = np.zeros(len(need), np.int64)
    start = np.zeros_like(need)
    free: list[np.ndarray] = []           # free cells left in each row, per variable
    for i in order:
        if not need[i].any():
            continue
        r = next((r for r, left in enumerate(free) if (left >= need[i]).all()), len(free))
        if r == len(free):
            free.append(width.copy())
        row[i], start[i] = r, width - free[r]
        free[r] -= need[i]
    return row, {v: start[:, k] for k, v in enumerate(names)}, len(free)


class PackedBatch(NamedTuple):
    """One step of a packed plan, one shard's part: the row length, the example indices
    (int64) this shard packs, and the rows every shard's part is packed into (the compiled
    shape is ``(rows, row_length)``; rows the part does not need are padding).

    The layout is ``first_fit(lengths[indices], row_length)`` -- the executor's own packing,
    so the rows the plan counted are the rows that run (over-long examples under
    ``overflow="truncate"`` counted at the largest row length, as the caller truncates them).
    """

    row_length: int
    indices: np.ndarray
    rows: int

    @property
    def cells(self) -> int:
        """Cells this shard computes at this step, padding included: ``rows * row_length``."""
        return self.rows * self.row_length


def packed_cells(plan, *, num_shards: int = 1) -> int:
    """Padded cells of a whole packed plan: ``rows * row_length`` summed over its steps and
    over all ``num_shards`` shards -- what `CostModel` prices per cell.

    ``plan`` is one shard's (`packed_batch_plan`'s return value); every shard's part of a
    step has the same ``(rows, row_length)``, so the other shards' cells are the same.

    >>> plan = packed_batch_plan([5, 3, 8, 2, 12], [10, 16], rows=1, num_shards=2, shuffle=False)
    >>> [(b.row_length, b.indices.tolist(), b.rows) for b in plan]
    [(10, [0], 1), (16, [4, 1], 1)]
    >>> packed_cells(plan, num_shards=2)                 # 2 shards x (1 x 10 + 1 x 16)
    52
    """
    S = check_int("packed_cells", "num_shards", num_shards, minimum=1)
    total = 0
    for i, b in enumerate(plan):
        if not isinstance(b, PackedBatch):
            raise TypeError(f"packed_cells: plan[{i}]: expected a PackedBatch, received "
                            f"{type(b).__name__} {b!r}")
        total += b.cells
    return S * total


def packed_batch_plan(
    lengths,
    row_lengths,
    *,
    rows: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    overflow: PackedOverflow = "error",
    exclude=(),
    room: int = 0,
) -> list[PackedBatch]:
    """This shard's steps for one epoch of packed rows, each as
    ``PackedBatch(row_length, indices, rows)``.

    ``row_lengths`` is a bucket policy (a list of sizes is ``Fixed(sizes)``): an example goes
    to the smallest row length >= its length. An example longer than the largest row length
    is a ValueError (`BucketOverflowError`) under ``overflow="error"``; under ``"truncate"``
    it goes to the largest row length and counts as that long (the caller truncates it).

    Rows per shard per step, per row length ``L``: ``rows``, or with ``max_tokens`` the most
    rows within the budget, ``max(1, max_tokens // L)`` (one row even when a single row is
    over it). Exactly one of the two must be given.

    Steps: each row length's examples (shuffled from ``(seed, epoch)`` when ``shuffle``, else
    in index order) are cut into consecutive runs, one run per global step. A run is split
    over the shards into contiguous parts (shard 0 the first), and it fits when every part
    packs with `first_fit` into ``rows`` rows of ``L``. The split is `batch_plan`'s -- part
    sizes differ by at most one example, the first ``len(run) % num_shards`` one longer --
    or, when only that packs, one of near-equal tokens: each example goes to the part whose
    share of the run's tokens holds the example's middle token, the parts then widened so
    that each has an example. (Counts balance long examples, one or two a row; tokens
    balance short ones, many a row.) Each step is the longest run that fits in the sense
    that one more example would not (first-fit row counts are not monotone in the run, so a
    longer run might fit again; the search stops at the first that does not), except that
    it leaves at least ``num_shards`` examples for the next step whenever at least
    ``2 * num_shards`` were left: then every shard gets an example in both. With one shard,
    then, every step but a row length's last is a run that one more example would overflow.

    The steps of all row lengths are then ordered: shuffled by the same generator when
    ``shuffle``, else by row length. Every shard must be called with the same arguments but
    ``shard_index``: each computes the same global plan and returns its part of every step,
    so all shards run the same ``(rows, row_length)`` at every step and the same number of
    steps, and every example is in exactly one shard's part of one step.

    ``exclude``: indices of examples this epoch has already run (the steps a layout choice
    timed, `polyexec.training.choose_layout`); they are left out of the plan, which then
    covers every other example exactly once.

    ``room``: cells each example takes after its own in a row, as a packed program that
    reads past each sequence's end (a value of length ``T + 2``) needs them: an example of
    length n takes ``n + room`` cells of a row of ``L + room`` (the last example of a row
    keeps its room past the row's L columns), which is how polyexec's executor packs such a
    program (``Plan.packing_room``). Row lengths, rows and cells are counted as without it.

    >>> [(b.row_length, b.indices.tolist(), b.rows)                 # 3 + 2 + 3 + 2 <= 8 + 2
    ...  for b in packed_batch_plan([3, 3, 4], [8], rows=1, shuffle=False, room=2)]
    [(8, [0, 1], 1), (8, [2], 1)]

    Every step runs all ``rows`` rows (one compiled shape per row length in use); rows a part
    does not fill are padding, priced by `packed_cells`. A shard's part is empty (an int64
    array of length 0: the shard runs ``rows`` rows of padding) only in the last step of a
    row length that had fewer than ``num_shards`` examples left for it: the row length has
    fewer than ``num_shards`` examples in all, or its last two steps hold fewer than
    ``2 * num_shards`` examples and did not fit in one step.

    Backfill: row lengths are cut longest first, and each non-empty part of a step takes,
    into the cells it leaves free (a long row's gap, the empty rows of a last step), the
    shorter row lengths' examples not yet planned, in plan order, each into the first row
    with room, so long as the part still packs into ``rows`` rows by `first_fit`. A step
    then runs at its longest example's row length, the one the executor picks, and holds
    shorter examples after its own; the shortest row length may be left no step at all.

    >>> lengths = [5, 3, 8, 2, 12, 7, 16, 1]
    >>> [(b.row_length, b.indices.tolist(), b.rows)
    ...  for b in packed_batch_plan(lengths, [10, 16], rows=2, shuffle=False)]
    [(10, [0, 2, 3], 2), (10, [5], 2), (16, [4, 6, 1, 7], 2)]

    (The 12 and the 16 leave 4 cells free in their rows of 16: the 3 and the 1 fill them.)

    Two shards, a budget of 20 cells per shard per step (2 rows of 10, 1 row of 16):

    >>> for shard in range(2):
    ...     print([(b.row_length, b.indices.tolist(), b.rows) for b in packed_batch_plan(
    ...         lengths, [10, 16], max_tokens=20, num_shards=2, shard_index=shard, shuffle=False)])
    [(10, [0, 2], 2), (16, [4, 1, 7], 1)]
    [(10, [3, 5], 2), (16, [6], 1)]
    """
    where = "packed_batch_plan"
    if (rows is None) == (max_tokens is None):
        raise ValueError(
            f"{where}: expected exactly one of rows= (rows per shard per step) or max_tokens= "
            f"(rows * row_length per shard per step), received rows={rows!r}, "
            f"max_tokens={max_tokens!r}")
    if rows is not None:
        rows = check_int(where, "rows", rows, minimum=1)
    if max_tokens is not None:
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
    shuffle = check_bool(where, "shuffle", shuffle)
    seed, epoch, S, shard_index = check_epoch_shard(where, seed, epoch, num_shards, shard_index)
    overflow = check_option(where, "overflow", overflow, _PACKED_OVERFLOW_OPTIONS)
    room = check_int(where, "room", room, minimum=0)
    arr = lengths_array(lengths, where=where)
    try:
        policy = as_policy(row_lengths)
    except (TypeError, ValueError) as e:  # name the argument: as_policy does not know it
        raise (TypeError if isinstance(e, TypeError) else ValueError)(
            f"{where}: row_lengths: {e}") from e

    done = np.asarray(exclude)
    if done.size and (done.dtype.kind not in "iu" or done.ndim != 1 or done.min() < 0
                      or done.max() >= arr.size):
        raise ValueError(f"{where}: exclude: expected example indices in [0, {arr.size}), "
                         f"received {done.dtype} array {done.tolist()[:8]}")
    steps = _planned_steps(arr.tobytes(), tuple(int(n) for n in policy.sizes), rows,
                           max_tokens, shuffle, seed, epoch, S, overflow,
                           done.astype(np.int64).tobytes(), room)
    # Copies: the planned steps are kept (below) for the next caller with these arguments.
    return [PackedBatch(L, idx[cut[shard_index]:cut[shard_index + 1]].copy(), R)
            for L, idx, R, cut in steps]


def packed_batches(
    lengths,
    row_lengths,
    *,
    rows: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    overflow: PackedOverflow = "error",
) -> Iterator[np.ndarray]:
    """The example indices (int64 arrays) of ``packed_batch_plan(...)``'s steps, in order.

    Arguments are checked and the plan is built when ``packed_batches`` is called, not on
    the first ``next``. Use ``packed_batch_plan`` for each step's row length and rows.

    >>> [b.tolist() for b in packed_batches([5, 3, 8, 2, 12], [10, 16], rows=1, shuffle=False)]
    [[0], [2, 3], [4, 1]]
    """
    plan = packed_batch_plan(
        lengths, row_lengths, rows=rows, max_tokens=max_tokens, shuffle=shuffle, seed=seed,
        epoch=epoch, num_shards=num_shards, shard_index=shard_index, overflow=overflow)
    return iter([b.indices for b in plan])


# A layout choice prices the same epochs' plans several times (`predict_packed` for each
# candidate, then the run its own), up to 45 ms each on pydoc's 3,242 examples: the same
# arguments give the same plan, so it is made once.
@functools.lru_cache(maxsize=16)
def _planned_steps(lengths: bytes, sizes: tuple[int, ...], rows, max_tokens, shuffle, seed,
                   epoch, S, overflow, exclude: bytes, room: int):
    return _packed_steps("packed_batch_plan", np.frombuffer(lengths, np.int64), sizes, rows,
                         max_tokens, shuffle, seed, epoch, S, overflow,
                         np.frombuffer(exclude, np.int64), room)


def _packed_steps(where, arr, sizes, rows, max_tokens, shuffle, seed, epoch, S, overflow,
                  exclude=(), room=0):
    """All shards' steps: (row_length, indices of the whole global step, rows per shard,
    the S + 1 offsets of the shards' parts in those indices), ``exclude`` left out. Each
    example packs as its length and ``room`` cells into rows of ``L + room``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    largest = int(sizes[-1])
    over = np.flatnonzero(arr > largest)
    eff = arr.copy()            # the length each example packs at
    if over.size:
        if overflow == "error":
            i = int(over[0])
            err = BucketOverflowError(arr[i], largest, index=i)
            # BucketOverflowError's own message offers overflow='exact', which packing has not.
            err.args = (f"{where}: lengths[{i}] = {int(arr[i])} is longer than the largest row "
                        f"length {largest} ({over.size} example{'s' if over.size > 1 else ''} "
                        f"over it); pass overflow='truncate' (the caller truncates them to "
                        f"{largest}) or a row length >= {int(arr[over].max())}",)
            raise err
        eff[over] = largest
    row_length = sizes[np.searchsorted(sizes, eff, side="left")]
    row_length[np.asarray(exclude, dtype=np.int64)] = 0         # in no row length's pool

    # One generator per (seed, epoch), as batch_plan: the same plan on every shard, a new
    # order every epoch.
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch])) if shuffle else None

    pools = {}
    for L in np.unique(row_length[row_length > 0]).tolist():
        pool = np.flatnonzero(row_length == L)
        pools[L] = rng.permutation(pool) if rng is not None else pool
    # Longest row length first, its steps' free cells filled with shorter examples; the
    # steps listed by row length ascending (the order of an unshuffled plan).
    cells = eff + room          # the cells each example takes in a row of L + room
    shorter = _Shorter(cells, pools, room)
    by_length: dict[int, list[tuple[int, np.ndarray, int, np.ndarray]]] = {}
    for L in sorted(pools, reverse=True):
        pool = shorter.pool(L)
        R = rows if rows is not None else max(1, max_tokens // L)
        by_length[L] = []
        for run, cut in _cut(cells[pool], L + room, R, S):
            idx, cut = shorter.fill(pool[run].astype(np.int64, copy=False), cut, L, R)
            by_length[L].append((L, idx, R, cut))
    steps = [step for L in sorted(by_length) for step in by_length[L]]
    if rng is not None and len(steps) > 1:
        steps = [steps[i] for i in rng.permutation(len(steps))]
    return steps


class _Shorter:
    """`packed_batch_plan`'s backfill: the examples of the shorter row lengths, in plan order,
    that no step has taken yet, and the filling of a step's free cells with them. Without it,
    on pydoc's 3,242 sentences (`polyexec-bench`'s default 32,768 tokens a step, rows of 256
    and 1,024) the plan filled 0.897 of its cells against Grain's first-fit 0.961 into rows of
    1,024 alone: examples of 257..1,024 bytes pair badly with one another."""

    def __init__(self, lengths: np.ndarray, pools: dict[int, np.ndarray], room: int = 0):
        # ``lengths``: the cells each example takes (its room included) in rows of
        # ``L + room``.
        self.lengths, self.pools, self.room = lengths, pools, room
        self.taken = np.zeros(lengths.size, bool)

    def pool(self, L: int) -> np.ndarray:
        """Row length ``L``'s examples that no longer row length's step took."""
        return self.pools[L][~self.taken[self.pools[L]]]

    def fill(self, idx: np.ndarray, cut: np.ndarray, L: int, R: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """One step's ``(indices, shard offsets)`` with its parts' free cells filled."""
        waiting = [self.pool(n) for n in sorted(self.pools, reverse=True) if n < L]
        if not waiting:
            return idx, cut
        waiting = np.concatenate(waiting)
        parts, offsets = [], [0]
        for s in range(cut.size - 1):
            part = idx[cut[s]:cut[s + 1]]
            if part.size:       # an empty part stays empty (`packed_batch_plan` says when)
                part = np.concatenate([part, self._gap_fillers(part, waiting, L + self.room,
                                                               R)])
            parts.append(part)
            offsets.append(offsets[-1] + part.size)
        return np.concatenate(parts), np.asarray(offsets, cut.dtype)

    def _gap_fillers(self, part: np.ndarray, waiting: np.ndarray, L: int, R: int
                     ) -> np.ndarray:
        """The waiting examples that go into ``part``'s free cells, each into the first row
        with room, marked taken. The part must still pack into ``R`` rows by `first_fit`,
        the executor's count: first-fit decreasing places the part's own, longer, examples
        as before and these in the gaps, but bin packing has anomalies, so it is checked."""
        lengths = self.lengths
        used = np.bincount(first_fit(lengths[part], L).row, weights=lengths[part], minlength=R)
        free = L - used.astype(np.int64)
        top = int(free.max(initial=0))
        # Only examples that fit the roomiest row are looked at: each one looked at is taken.
        waiting = waiting[~self.taken[waiting] & (lengths[waiting] <= top)]
        chosen = []
        while waiting.size:
            i, waiting = int(waiting[0]), waiting[1:]
            n = int(lengths[i])
            free[int(np.argmax(free >= n))] -= n
            chosen.append(i)
            if int(free.max()) < top:
                top = int(free.max())
                waiting = waiting[lengths[waiting] <= top]
        chosen = np.asarray(chosen, np.int64)
        while chosen.size and first_fit(lengths[np.concatenate([part, chosen])], L).rows > R:
            chosen = chosen[:-1]
        self.taken[chosen] = True
        return chosen


def _count_cut(k: int, S: int) -> np.ndarray:
    """The S + 1 offsets of `batch_plan`'s split of k examples (its ``_shard_slice``):
    contiguous parts whose sizes differ by at most one, the first ``k % S`` one longer."""
    base, extra = divmod(k, S)
    s = np.arange(S + 1)
    return s * base + np.minimum(s, extra)


def _token_cut(w: np.ndarray, S: int) -> np.ndarray:
    """The S + 1 offsets of contiguous parts of near-equal tokens: each example goes to the
    part whose share of the run's tokens holds the example's middle token, then the offsets
    are pushed apart so that every part gets at least one example (``len(w) >= S``)."""
    k = w.size
    c = np.cumsum(w)
    total = int(c[-1])
    # Example j's middle token is at c[j] - w[j]/2; in units of 1/(2*total) to stay exact.
    part = np.minimum((2 * c - w) * S // (2 * total), S - 1)
    cut = np.searchsorted(part, np.arange(S + 1), side="left")
    cut[S] = k
    for s in range(1, S):              # at least one example in each part, ...
        cut[s] = max(cut[s], cut[s - 1] + 1)
    for s in range(S - 1, 0, -1):      # ... and room for one in each later part
        cut[s] = min(cut[s], cut[s + 1] - 1)
    return cut


def _cut(plen: np.ndarray, L: int, R: int, S: int) -> list[tuple[slice, np.ndarray]]:
    """Cut one row length's examples (lengths ``plen``, in plan order) into steps: for each,
    the slice of ``plen`` and the S + 1 offsets of the shards' parts within it."""
    n = plen.size
    csum = np.concatenate(([0], np.cumsum(plen)))

    def rows_for(p: int, cut: np.ndarray) -> int:
        """The most rows any part of run ``p + cut`` needs with first_fit, or once it is over
        R, the first count over R found: the run does not fit either way (and the heaviest
        parts, tried first, are the likeliest not to fit, so first_fit rarely runs on all)."""
        bounds = p + cut
        tokens = np.diff(csum[bounds])
        heaviest = int(tokens.max())
        if heaviest > R * L:            # over R rows by tokens alone: first_fit need not run
            return -(-heaviest // L)
        most = 0
        for s in np.argsort(-tokens, kind="stable").tolist():
            a, b = int(bounds[s]), int(bounds[s + 1])
            if b > a:                   # an empty part (fewer than S examples): no rows
                most = max(most, first_fit(plen[a:b], L).rows)
                if most > R:
                    break
        return most

    def split(p: int, k: int) -> tuple[int, np.ndarray]:
        """(rows the run ``[p, p+k)`` needs, its split): by count as batch_plan splits a
        step, or by tokens where only that packs. Counts balance runs of long examples (one
        or two a row: rows follow the count); tokens balance runs of short ones (rows follow
        the tokens). Measured on 10^5 lognormal lengths (median 128, 1..512), 8 shards of 16
        rows: into rows of 512 alone the count split filled 0.82 of the cells, the token
        split 0.96, both 0.96 (one shard: 0.97); into rows of 64/128/256/512, 0.76, 0.73
        and 0.76."""
        cut = _count_cut(k, S)
        rows = rows_for(p, cut)
        if rows <= R or k <= S or csum[p + k] == csum[p]:
            return rows, cut
        by_tokens = _token_cut(plen[p:p + k], S)
        rows_t = rows_for(p, by_tokens)
        return (rows_t, by_tokens) if rows_t < rows else (rows, cut)

    def take(p: int, limit: int) -> tuple[int, np.ndarray]:
        """A run at ``p`` of at most ``limit`` examples that fits while one more would not
        (or ``limit`` examples), and its split. ``min(S, limit)`` examples always fit: one
        per shard, one row each."""
        lo = min(S, limit)
        # Tokens bound the run from above: all parts together hold at most S*R*L (capped at
        # the tokens there are, so that a huge ``rows`` stays within int64).
        room = int(csum[p]) + min(S * R * L, int(csum[-1]))
        hi = int(np.searchsorted(csum, room, side="right")) - 1 - p
        hi = max(lo, min(hi, limit))
        rows, cut = split(p, hi)
        if rows <= R:
            return hi, cut
        # Back off in proportion to the overflow (first_fit fills rows well, so the answer
        # is near), then bisect between a run that fits and one that does not.
        good, good_cut, bad = lo, _count_cut(lo, S), hi
        k = hi
        while True:
            k = max(lo, min(bad - 1, k * R // rows))
            if k <= lo:
                break
            rows, cut = split(p, k)
            if rows <= R:
                good, good_cut = k, cut
                break
            bad = k
        while bad - good > 1:
            mid = (good + bad) // 2
            rows, cut = split(p, mid)
            if rows <= R:
                good, good_cut = mid, cut
            else:
                bad = mid
        return good, good_cut

    steps: list[tuple[slice, np.ndarray]] = []
    p = 0
    while p < n:
        m = n - p
        k, cut = take(p, m)
        if 0 < m - k < S <= m - S:
            # Fewer than S would be left: some shard's part of the next step would be empty.
            # Leave S or more instead (S always fit in a step), since at least 2S are here.
            k, cut = take(p, m - S)
        steps.append((slice(p, p + k), cut))
        p += k
    return steps
