"""Bucket sets chosen by predicted run time: padded cells x step cost + compiles x compile cost.

A bucket set is more than its lengths: every batch runs at ``(rows, length)``, and each
distinct pair is one compile. `predict` prices any policy from the batches `batch_plan` would
really make; `Auto.fit` finds the set -- length boundaries, and for each bucket whether its
partial last batch gets rows of its own -- that minimises the prediction for a run's
expected number of epochs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

import numpy as np

from ._batching import batch_size_for, exact_sizes, global_steps
from ._checks import check_batching, check_int, lengths_array, normalise_sizes
from ._packing import packed_batch_plan
from ._policies import BucketPolicy, as_policy, distinct_counts

__all__ = ["Auto", "CostModel", "Prediction", "predict", "predict_packed"]

# Above this many distinct lengths Auto.fit searches boundaries among this many of them
# (every k-th distinct length, the longest always): the DP is O(D^2) numpy work, ~0.1 s here.
_MAX_CANDIDATES = 2048


def _check_seconds(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name}: expected a number of seconds >= 0, received "
                        f"{type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name}: expected a finite number >= 0, received {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What a run's time is made of: ``compile_seconds`` per compiled ``(rows, length)``
    shape, and per step ``seconds_per_step + seconds_per_cell * rows * length`` (all shards'
    rows). ``polyexec.training.measure_cost`` measures one from a compiled step.

    >>> CostModel(compile_seconds=2.0, seconds_per_cell=1e-6).step_seconds(32, 125)
    0.004
    """

    compile_seconds: float
    seconds_per_cell: float
    seconds_per_step: float = 0.0

    def __post_init__(self):
        for name in ("compile_seconds", "seconds_per_cell", "seconds_per_step"):
            object.__setattr__(self, name, _check_seconds("CostModel", name, getattr(self, name)))

    def step_seconds(self, rows: int, length: int) -> float:
        return self.seconds_per_step + self.seconds_per_cell * rows * length


class Prediction(NamedTuple):
    """A run's predicted cost. ``shapes``: the compiled ``(rows, length)`` pairs, rows per
    shard; ``cells``: padded cells over the run (rows of every shard x length); ``real``: real
    tokens over the run; ``padding_efficiency`` = real / cells, padded rows included."""

    seconds: float
    compile_seconds: float
    step_seconds: float
    compiles: int
    steps: int
    cells: int
    real: int
    shapes: tuple[tuple[int, int], ...]

    @property
    def padding_efficiency(self) -> float:
        return self.real / self.cells if self.cells else 1.0

    def describe(self) -> str:
        compiles = (f"{self.compiles} compiles x {self.compile_seconds / self.compiles:.2f} s"
                    if self.compiles else "no compiles")
        return (f"{compiles} + {self.steps} steps {self.step_seconds:.1f} s = {self.seconds:.1f} s "
                f"(padding efficiency {self.padding_efficiency:.3f}, rows included)")


def _check_cost(where: str, cost) -> CostModel:
    if not isinstance(cost, CostModel):
        raise TypeError(f"{where}: cost: expected a buckets.CostModel, received "
                        f"{type(cost).__name__} {cost!r}")
    return cost


def _check_shapes(where: str, compiled) -> frozenset[tuple[int, int]]:
    if isinstance(compiled, (str, bytes)) or not isinstance(compiled, Iterable):
        raise TypeError(f"{where}: compiled: expected (rows, length) pairs, received {compiled!r}")
    out = set()
    for i, pair in enumerate(compiled):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{where}: compiled[{i}]: expected a (rows, length) pair, received "
                            f"{pair!r}")
        out.add((check_int(where, f"compiled[{i}][0]", pair[0], minimum=1),
                 check_int(where, f"compiled[{i}][1]", pair[1], minimum=1)))
    return frozenset(out)


def _check_run(where, lengths, cost, epochs, batch_size, max_tokens, num_shards, row_multiple,
               compiled, *, minimum: int):
    """The arguments `predict` and `Auto.fit` share, checked and normalised."""
    batch_size, max_tokens = check_batching(where, batch_size, max_tokens)
    return (lengths_array(lengths, where=where, minimum=minimum), _check_cost(where, cost),
            check_int(where, "epochs", epochs, minimum=1), batch_size, max_tokens,
            check_int(where, "num_shards", num_shards, minimum=1),
            check_int(where, "row_multiple", row_multiple, minimum=1),
            _check_shapes(where, compiled))


def predict(lengths, policy, cost: CostModel, *, epochs: int = 1, batch_size: int | None = None,
            max_tokens: int | None = None, num_shards: int = 1, row_multiple: int = 1,
            partial_rows=None, compiled: Collection[tuple[int, int]] = ()) -> Prediction:
    """The predicted cost of ``epochs`` passes of `batch_plan` over ``lengths``.

    Counted from the very steps `batch_plan` makes (per bucket their number and sizes are the
    same every epoch; only the order is shuffled). Rows per shard are rounded up to
    ``row_multiple`` (the local devices a batch is split over); shapes in ``compiled`` are
    free (already compiled).

    >>> cost = CostModel(compile_seconds=1.0, seconds_per_cell=0.01)
    >>> p = predict([3, 4, 9, 10, 2], [4, 16], cost, batch_size=2, epochs=2)
    >>> p.compiles, p.steps, p.cells, round(p.seconds, 2), round(p.padding_efficiency, 3)
    (2, 6, 96, 2.96, 0.583)
    >>> predict([3, 4, 9, 10, 2], [4, 16], cost, batch_size=2, epochs=2, partial_rows="exact").cells
    88
    """
    arr, cost, epochs, batch_size, max_tokens, S, m, free = _check_run(
        "predict", lengths, cost, epochs, batch_size, max_tokens, num_shards, row_multiple,
        compiled, minimum=0)
    policy = as_policy(policy)
    steps = global_steps(arr, policy, batch_size, max_tokens, False, 0, 0, False, S, "error",
                          exact_sizes("predict", policy, partial_rows))
    shapes, cells = set(), 0
    for size, _, rows in steps:
        rows = -(-rows // m) * m
        shapes.add((rows, size))
        cells += S * rows * size
    return _priced(cost, shapes, free, epochs * len(steps), epochs * cells, epochs * int(arr.sum()))


def _priced(cost: CostModel, shapes: set, free: frozenset, steps: int, cells: int,
            real: int) -> Prediction:
    """The `Prediction` of a run's totals: every shape not in ``free`` compiles once."""
    new = shapes - free
    compile_s = cost.compile_seconds * len(new)
    step_s = cost.seconds_per_step * steps + cost.seconds_per_cell * cells
    return Prediction(seconds=compile_s + step_s, compile_seconds=compile_s, step_seconds=step_s,
                      compiles=len(new), steps=steps, cells=cells, real=real,
                      shapes=tuple(sorted(shapes)))


def predict_packed(lengths, row_lengths, cost: CostModel | Mapping[int, CostModel], *,
                   epochs: int = 1, rows: int | None = None, max_tokens: int | None = None,
                   seed: int = 0, num_shards: int = 1, compiled: Collection[tuple[int, int]] = (),
                   room: int = 0) -> Prediction:
    """The predicted cost of ``epochs`` epochs of `packed_batch_plan` over ``lengths``:
    counted from the very plans the run makes (epoch ``e`` shuffled from ``(seed, e)``; the
    first-fit rows differ a little from epoch to epoch), so ``cells`` are the cells that run.
    ``shapes``: the compiled ``(rows, row_length)`` pairs; ``compiled`` ones are free.
    ``cost``: one for every row length, or one per row length (``{L: CostModel}``) where
    they were measured apart -- a cell of a short row can cost less than one of a long row.
    ``room``: the cells each example takes after its own (`packed_batch_plan`'s).

    >>> cost = CostModel(compile_seconds=1.0, seconds_per_cell=0.01)
    >>> p = predict_packed([3, 4, 9, 10, 2], [16], cost, rows=1, epochs=2)
    >>> p.compiles, p.steps, p.cells, p.shapes, round(p.padding_efficiency, 3)
    (1, 5, 80, ((1, 16),), 0.7)
    >>> predict([3, 4, 9, 10, 2], [4, 16], cost, batch_size=2, epochs=2).cells   # padded rows
    96
    >>> cheap = CostModel(compile_seconds=1.0, seconds_per_cell=0.005)
    >>> p = predict_packed([3, 4, 9, 10, 2], [4, 16], {4: cheap, 16: cost}, max_tokens=16)
    >>> p.shapes, p.cells, round(p.step_seconds, 2)   # 16 cells of rows of 4 at the cheap rate
    (((1, 16), (4, 4)), 48, 0.4)
    """
    arr = lengths_array(lengths, where="predict_packed", minimum=0)
    costs = ({int(n): _check_cost("predict_packed", c) for n, c in cost.items()}
             if isinstance(cost, Mapping) else None)
    cost = _check_cost("predict_packed", cost) if costs is None else None
    epochs = check_int("predict_packed", "epochs", epochs, minimum=1)
    S = check_int("predict_packed", "num_shards", num_shards, minimum=1)
    free = _check_shapes("predict_packed", compiled)
    shapes, cells, steps = set(), {}, {}
    for epoch in range(epochs):
        plan = packed_batch_plan(arr, row_lengths, rows=rows, max_tokens=max_tokens, seed=seed,
                                 epoch=epoch, num_shards=S, room=room)
        shapes.update((b.rows, b.row_length) for b in plan)
        for b in plan:
            cells[b.row_length] = cells.get(b.row_length, 0) + b.rows * b.row_length * S
            steps[b.row_length] = steps.get(b.row_length, 0) + 1
    real = epochs * int(arr.sum())
    if costs is None:
        return _priced(cost, shapes, free, sum(steps.values()), sum(cells.values()), real)
    missing = sorted(set(cells) - set(costs))
    if missing:
        raise ValueError(f"predict_packed: cost: expected a CostModel for every row length the "
                         f"plan uses, received none for {missing}")
    parts = [_priced(costs[n], {s for s in shapes if s[1] == n}, free, steps[n], cells[n], 0)
             for n in sorted(cells)]
    return Prediction(seconds=sum(p.seconds for p in parts),
                      compile_seconds=sum(p.compile_seconds for p in parts),
                      step_seconds=sum(p.step_seconds for p in parts),
                      compiles=sum(p.compiles for p in parts), steps=sum(steps.values()),
                      cells=sum(cells.values()), real=real, shapes=tuple(sorted(shapes)))


@dataclasses.dataclass(frozen=True)
class Auto(BucketPolicy):
    """Bucket sizes and partial-batch rows chosen by predicted run time; build it with
    `Auto.fit`. ``partial_rows``: the sizes whose partial last batch runs at its own (exact)
    rows -- `batch_plan` follows it. ``prediction``: the cost `Auto.fit` predicted.

    >>> lengths = [5] * 40 + [6] * 30 + [50] * 9 + [51] * 3
    >>> cost = CostModel(compile_seconds=1.0, seconds_per_cell=1e-4)
    >>> Auto.fit(lengths, cost, epochs=1, batch_size=16)          # a short run: one compile
    Auto(sizes=(51,), partial_rows=())
    >>> Auto.fit(lengths, cost, epochs=100, batch_size=16).sizes  # a long one: worth two
    (6, 51)
    """

    sizes: tuple[int, ...]
    partial_rows: tuple[int, ...] = ()
    prediction: Prediction | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "sizes", normalise_sizes("Auto", self.sizes))
        exact = tuple(sorted({check_int("Auto", "partial_rows[]", s, minimum=1)
                              for s in self.partial_rows}))
        stray = [s for s in exact if s not in self.sizes]
        if stray:
            raise ValueError(f"Auto: partial_rows: expected bucket sizes of {self.sizes}, "
                             f"received {stray}")
        object.__setattr__(self, "partial_rows", exact)

    @classmethod
    def fit(cls, lengths, cost: CostModel, *, epochs: int, batch_size: int | None = None,
            max_tokens: int | None = None, num_shards: int = 1, row_multiple: int = 1,
            compiled: Collection[tuple[int, int]] = ()) -> "Auto":
        """The bucket set with the least predicted time for ``epochs`` passes over ``lengths``.

        Exact dynamic programming over the distinct lengths: a bucket covering the distinct
        lengths ``(i..j]`` runs at length ``v[j]`` and costs its steps and padded cells, plus
        one compile for its full batches and -- when its partial last batch runs at exact
        rows, whichever of the two is cheaper -- one for that batch. With ``num_shards > 1``
        a bucket whose leftovers `batch_plan` would move up is not considered, and the few
        examples rebalancing moves are priced where they started: on small random cases with
        2-4 shards the choice was within 1.26x of the brute-force optimum (the returned
        ``prediction`` is always `predict`'s, from the real plan). Above 2,048 distinct
        lengths the boundaries are searched among 2,048 of them.

        ``compiled``: ``(rows, length)`` shapes already compiled (free), e.g. the one a cost
        measurement compiled.
        """
        arr, cost, epochs, batch_size, max_tokens, S, m, free = _check_run(
            "Auto.fit", lengths, cost, epochs, batch_size, max_tokens, num_shards, row_multiple,
            compiled, minimum=1)
        sizes, exact = _fit_by_cost(arr, cost, epochs, batch_size, max_tokens, S, m, free)
        prediction = predict(arr, sizes, cost, epochs=epochs, batch_size=batch_size,
                             max_tokens=max_tokens, num_shards=S, row_multiple=m,
                             partial_rows=exact, compiled=free)
        return cls(sizes, exact, prediction)


def _fit_by_cost(arr, cost, epochs, batch_size, max_tokens, S, m, free):
    values, counts = distinct_counts(arr)
    C = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    if values.size > _MAX_CANDIDATES:     # keep every k-th boundary and the longest length
        keep = np.unique(np.linspace(0, values.size - 1, _MAX_CANDIDATES).round().astype(np.int64))
        values, C = values[keep], np.concatenate(([0], C[keep + 1]))
    D = values.size
    a, o, c, E = cost.seconds_per_cell, cost.seconds_per_step, cost.compile_seconds, epochs
    best = np.zeros(D + 1)
    parent = np.zeros(D + 1, dtype=np.int64)
    split = np.zeros(D + 1, dtype=bool)     # the bucket ending at j: exact rows for its partial
    for j in range(1, D + 1):
        T = int(values[j - 1])
        b = batch_size if batch_size is not None else batch_size_for(T, max_tokens)
        rb = -(-b // m) * m
        n = C[j] - C[:j]                    # examples of bucket (i..j] for every start i < j
        full, r = np.divmod(n, S * b)
        rr = -(-(-(-r // S)) // m) * m      # the partial step's rows per shard, exactly
        c_full = 0.0 if (rb, T) in free else c
        steps = full + (r > 0)
        # Full rows: one shape. Exact rows: the partial step at rr rows, one more shape when
        # full steps exist too (and rr differs from rb).
        t_full = c_full + E * (o * steps + a * S * rb * T * steps)
        c_partial = np.where(np.isin(rr, [s for s, t in free if t == T]), 0.0, c)
        compiles_exact = np.where(rr == rb, c_full, np.where(full > 0, c_full, 0.0) + c_partial)
        t_exact = compiles_exact + E * (o * steps + a * S * T * (full * rb + rr))
        t_exact = np.where(r > 0, t_exact, np.inf)
        use_exact = t_exact < t_full
        total = best[:j] + np.where(use_exact, t_exact, t_full)
        if j < D:
            # Fewer leftovers than shards and no full step to rebalance with: batch_plan moves
            # them up a bucket, so this bucket is never better than merging it upward.
            total[(r > 0) & (r < S) & ~((full >= 1) & (b >= 2))] = np.inf
        i = int(np.argmin(total))           # the first minimum: ties go to fewer buckets
        best[j], parent[j], split[j] = total[i], i, use_exact[i]
    sizes, exact = [], []
    j = D
    while j > 0:
        sizes.append(int(values[j - 1]))
        if split[j]:
            exact.append(int(values[j - 1]))
        j = int(parent[j])
    return tuple(sorted(sizes)), tuple(sorted(exact))
