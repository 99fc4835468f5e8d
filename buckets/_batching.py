"""Length-grouped batching: every batch falls in one bucket, every example is used once.

The plan is computed for all shards at once (from the same lengths, seed and epoch every
data-parallel replica computes the same global plan) and each shard takes its slice of every
global step, so at step s all replicas run the same bucket -- the same compiled program.
"""

from __future__ import annotations

import typing
from collections.abc import Collection
from typing import Iterator, Literal, NamedTuple

import numpy as np

from ._checks import (check_batching, check_bool, check_epoch_shard, check_int, check_option,
                      lengths_array)
from ._policies import BucketOverflowError, as_policy

__all__ = ["Batch", "Overflow", "PartialRows", "batch_plan", "batch_size_for", "batches"]

Overflow = Literal["error", "truncate", "exact"]
_OVERFLOW_OPTIONS: tuple[str, ...] = typing.get_args(Overflow)
PartialRows = Literal["full", "exact"]
_PARTIAL_OPTIONS: tuple[str, ...] = typing.get_args(PartialRows)


class Batch(NamedTuple):
    """One batch of a plan: the bucket size to pad to, the example indices (int64), and the
    rows every shard pads this step's batch to (its compiled shape is ``(rows, bucket_size)``).
    """

    bucket_size: int
    indices: np.ndarray
    rows: int


def batch_size_for(bucket_size: int, max_tokens: int) -> int:
    """The largest power of two ``b`` with ``b * bucket_size <= max_tokens`` (at least 1).

    Powers of two keep the set of batch shapes small (one per bucket, from a set of
    ~log2(max_tokens) values) while giving short buckets large batches.

    >>> [batch_size_for(s, 4096) for s in (16, 100, 1024, 5000)]
    [256, 32, 4, 1]
    """
    bucket_size = check_int("batch_size_for", "bucket_size", bucket_size, minimum=1)
    max_tokens = check_int("batch_size_for", "max_tokens", max_tokens, minimum=1)
    q = max_tokens // bucket_size
    return 1 if q < 1 else 1 << (q.bit_length() - 1)


def _shard_slice(m: int, num_shards: int, shard_index: int) -> slice:
    """Contiguous near-even split (np.array_split sizes): the first m % S shards get one more."""
    base, extra = divmod(m, num_shards)
    start = shard_index * base + min(shard_index, extra)
    return slice(start, start + base + (1 if shard_index < extra else 0))


def batch_plan(
    lengths,
    policy,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = False,
    num_shards: int = 1,
    shard_index: int = 0,
    overflow: Overflow = "error",
    partial_rows: PartialRows | Collection[int] | None = None,
) -> list[Batch]:
    """This shard's batches for one epoch, each as ``Batch(bucket_size, indices, rows)``.

    Examples are grouped by bucket (``policy.bucket_for(length)``; a plain list of sizes is
    accepted as ``Fixed(sizes)``), shuffled within each bucket, cut into batches, and the
    batch order is shuffled -- all deterministically from ``(seed, epoch)``. Every shard must
    be called with the same lengths, policy, seed and epoch.

    Batch size: ``batch_size`` examples, or with ``max_tokens`` the largest power of two
    ``b`` with ``b * bucket_size <= max_tokens``. Exactly one of the two must be given. A
    bucket in use above ``max_tokens`` (not even one row fits the budget) is a ValueError
    naming the first example in it, except for over-long examples under ``overflow="exact"``,
    which get a batch of their own whatever the budget.

    Sharding (``num_shards`` > 1): a global step holds ``num_shards * b`` examples of one
    bucket and shard ``i`` takes the i-th contiguous part, so all shards get the same number
    of batches and at every step the same bucket. Shards hold disjoint examples whose union
    is every example. With ``drop_remainder=False`` nothing is dropped; the last step of a
    bucket with ``r`` leftover examples is handled so that shards rarely get an empty batch:

    - ``r >= num_shards``: one smaller step, split as evenly as possible (sizes differ by <= 1).
    - ``r < num_shards`` and ``b >= 2`` and the bucket has a full step: the last two steps are
      rebalanced to ``num_shards*b + r - num_shards`` and ``num_shards`` examples, so every
      shard gets >= 1 example in both.
    - otherwise the ``r`` examples move up into the next larger bucket that is in use (they
      fit there; it costs some padding but no extra compile).
    - only when that happens in the largest bucket in use do ``num_shards - r`` shards get an
      empty batch (an int64 array of length 0) at that one step; it needs ``b == 1`` there
      or fewer examples than shards in it.
    With one shard every batch is non-empty and examples never change bucket.

    ``partial_rows`` -- the rows a bucket's last, partial step is padded to (``Batch.rows``;
    one compiled shape per distinct ``(rows, bucket_size)``): ``"full"`` pads it to the full
    batch (no extra shape, wasted rows), ``"exact"`` gives it just the rows its largest shard
    needs (one more shape per bucket with a remainder, no wasted rows), a collection of bucket
    sizes does ``"exact"`` for those only. Default: the policy's own choice (`Auto` decides it
    by cost), else ``"full"``. The count of examples per bucket is the same every epoch, so
    these shapes are too.

    ``drop_remainder=True`` drops, per bucket, the examples that do not fill a complete
    global step (fewer than ``num_shards * b`` per bucket, chosen at random when shuffling);
    every batch then has exactly ``b`` examples. Nothing else is ever dropped.

    ``overflow`` -- examples longer than the largest bucket:
    ``"error"`` (default) raises BucketOverflowError naming the first such example;
    ``"truncate"`` puts them in the largest bucket (the caller truncates them to it);
    ``"exact"`` gives each one a batch of its own, with ``bucket_size`` = its length (with
    shards, over-long examples of one length are dealt one per shard per step, and leftovers
    move up to the next over-long length as above).

    >>> plan = batch_plan([3, 9, 4, 10, 2], [4, 16], batch_size=2, shuffle=False)
    >>> [(b.bucket_size, b.indices.tolist(), b.rows) for b in plan]
    [(4, [0, 2], 2), (4, [4], 2), (16, [1, 3], 2)]
    >>> [b.rows for b in batch_plan([3, 9, 4, 10, 2], [4, 16], batch_size=2, shuffle=False,
    ...                             partial_rows="exact")]
    [2, 1, 2]
    >>> [(b.bucket_size, b.indices.tolist()) for b in
    ...  batch_plan([3, 9, 4, 10, 2], [4, 16], max_tokens=16, shuffle=False)]
    [(4, [0, 2, 4]), (16, [1]), (16, [3])]
    """
    where = "batch_plan"
    batch_size, max_tokens = check_batching(where, batch_size, max_tokens)
    shuffle = check_bool(where, "shuffle", shuffle)
    drop_remainder = check_bool(where, "drop_remainder", drop_remainder)
    seed, epoch, S, shard_index = check_epoch_shard(where, seed, epoch, num_shards, shard_index)
    overflow = check_option(where, "overflow", overflow, _OVERFLOW_OPTIONS)
    arr = lengths_array(lengths, where=where)
    policy = as_policy(policy)
    exact = exact_sizes(where, policy, partial_rows)

    if max_tokens is not None:
        check_budget(where, arr, policy, max_tokens, overflow)
    steps = global_steps(arr, policy, batch_size, max_tokens, shuffle, seed, epoch,
                          drop_remainder, S, overflow, exact)
    if S == 1:
        return [Batch(size, idx, rows) for size, idx, rows in steps]
    return [Batch(size, idx[_shard_slice(idx.size, S, shard_index)], rows)
            for size, idx, rows in steps]


def check_budget(where: str, arr: np.ndarray, policy, max_tokens: int, overflow: str) -> None:
    """Refuse a token budget that some bucket in use cannot meet even with one row.

    `batch_size_for` gives such a bucket batches of one, so without this check every batch of
    it would be silently over ``max_tokens`` (the padded cells the budget exists to bound).
    Over-long examples under ``overflow="exact"`` are exempt: that option asks for a batch of
    its own at the example's own length, whatever the budget. Under ``"error"`` they are left
    to `global_steps`, which raises BucketOverflowError for them.
    """
    sizes = np.asarray(policy.sizes, dtype=np.int64)
    largest = int(sizes[-1])
    if largest <= max_tokens:
        return
    fits = arr <= largest
    bucket = np.zeros_like(arr)
    bucket[fits] = sizes[np.searchsorted(sizes, arr[fits], side="left")]
    if overflow == "truncate":
        bucket[~fits] = largest
    over = np.flatnonzero(bucket > max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"{where}: max_tokens: example {i} has length {int(arr[i])}, whose bucket "
            f"{int(bucket[i])} is over the budget even as a batch of one row "
            f"({over.size} example{'s' if over.size > 1 else ''} in buckets over it); expected "
            f"max_tokens >= {int(bucket.max())} (the largest bucket in use) or a policy whose "
            f"buckets in use are <= max_tokens, received max_tokens={max_tokens}")


def exact_sizes(where: str, policy, partial_rows) -> frozenset[int] | bool:
    """The bucket sizes whose partial step gets exact rows, or True for all of them.

    Not in ``__all__`` but shared: `predict` and `report` price the very steps `batch_plan`
    makes, so they call this and `global_steps` rather than a copy."""
    if partial_rows is None:
        partial_rows = getattr(policy, "partial_rows", "full")
    if isinstance(partial_rows, str):
        if check_option(where, "partial_rows", partial_rows, _PARTIAL_OPTIONS) == "exact":
            return True
        return frozenset()
    if not isinstance(partial_rows, Collection):
        raise TypeError(f"{where}: partial_rows: expected 'full', 'exact' or a collection of "
                        f"bucket sizes, received {type(partial_rows).__name__} {partial_rows!r}")
    return frozenset(check_int(where, "partial_rows[]", s, minimum=1) for s in partial_rows)


def batches(
    lengths,
    policy,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_remainder: bool = False,
    num_shards: int = 1,
    shard_index: int = 0,
    overflow: Overflow = "error",
    partial_rows: PartialRows | Collection[int] | None = None,
) -> Iterator[np.ndarray]:
    """The example indices (int64 arrays) of ``batch_plan(...)``'s batches, in order.

    Arguments are checked and the plan is built when ``batches`` is called, not on the first
    ``next``. Use ``batch_plan`` when the bucket size of each batch is needed.

    >>> [b.tolist() for b in batches([3, 9, 4, 10, 2], [4, 16], batch_size=2, shuffle=False)]
    [[0, 2], [4], [1, 3]]
    """
    plan = batch_plan(
        lengths, policy, batch_size=batch_size, max_tokens=max_tokens, shuffle=shuffle,
        seed=seed, epoch=epoch, drop_remainder=drop_remainder, num_shards=num_shards,
        shard_index=shard_index, overflow=overflow, partial_rows=partial_rows,
    )
    return iter([b.indices for b in plan])


def global_steps(arr, policy, batch_size, max_tokens, shuffle, seed, epoch,
                  drop_remainder, S, overflow, exact=frozenset()) -> list[tuple[int, np.ndarray, int]]:
    """All shards' steps: (bucket_size, indices of the whole global step, rows per shard)."""
    sizes = np.asarray(policy.sizes, dtype=np.int64)
    largest = int(sizes[-1])
    over = arr > largest
    bucket = np.empty_like(arr)
    fits = ~over
    bucket[fits] = sizes[np.searchsorted(sizes, arr[fits], side="left")]
    if over.any():
        if overflow == "error":
            i = int(np.flatnonzero(over)[0])
            raise BucketOverflowError(arr[i], largest, index=i)
        bucket[over] = largest if overflow == "truncate" else arr[over]

    # One generator per (seed, epoch): same plan on every shard, a new order every epoch.
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch])) if shuffle else None

    order = np.argsort(bucket, kind="stable")  # group by bucket, index order within
    group_sizes, starts = np.unique(bucket[order], return_index=True)
    ends = np.append(starts[1:], arr.size)

    steps: list[tuple[int, np.ndarray]] = []
    rows_of: dict[int, int] = {}        # bucket size -> full rows per shard
    carry = np.empty(0, dtype=np.int64)
    n_groups = group_sizes.size
    for g in range(n_groups):
        size = int(group_sizes[g])
        pool = order[starts[g]:ends[g]]
        if carry.size:
            pool = np.concatenate((carry, pool))
            carry = np.empty(0, dtype=np.int64)
        if rng is not None:
            pool = rng.permutation(pool)
        if size > largest:  # overflow="exact": a batch of its own (one per shard per step)
            b = 1
        elif batch_size is not None:
            b = batch_size
        else:
            b = batch_size_for(size, max_tokens)
        rows_of[size] = b
        step = S * b
        full, r = divmod(pool.size, step)
        cut = full * step
        for s in range(full):
            steps.append((size, pool[s * step:(s + 1) * step]))
        if r == 0 or drop_remainder:
            continue
        rest = pool[cut:]
        if r >= S:
            steps.append((size, rest))
        elif full >= 1 and b >= 2:
            # Rebalance the last full step and the remainder: (S*b + r - S) then S examples,
            # both >= S, both <= S*b, so every shard gets 1..b examples in each.
            tail = pool[cut - step:]
            steps[-1] = (size, tail[: step + r - S])
            steps.append((size, tail[step + r - S:]))
        elif g + 1 < n_groups:
            carry = rest  # fits the next larger bucket in use; no new compiled shape
        else:
            steps.append((size, rest))  # largest bucket: some shards get an empty batch

    if rng is not None and len(steps) > 1:
        perm = rng.permutation(len(steps))
        steps = [steps[i] for i in perm]

    def rows(size: int, n: int) -> int:
        # A full step's ceil(n / S) is the full b, so "exact" only changes partial steps.
        return -(-n // S) if exact is True or size in exact else rows_of[size]

    return [(size, idx.astype(np.int64, copy=False), max(rows(size, idx.size), 1))
            for size, idx in steps]
