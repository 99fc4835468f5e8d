"""``buckets="auto"``: measure one compile and one step, then choose the bucket set by cost
(`choose_buckets`, which `fit` and ``polyexec-bench`` both call).

The cost model (`buckets.CostModel`) needs seconds per compile and seconds per padded cell.
Both come from the run's own step at its largest bucket -- a shape almost every run uses
anyway, so the measurement's compile is rarely wasted -- and `buckets.Auto.fit` picks the
(length x rows) set with the least predicted time for the epochs still to run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import buckets as _buckets

from .. import Bucketed
from .._cache import count_compiles
from .._errors import OptionError
from ._data import Batching, round_up
from ._parallel import DataParallel
from ._state import copy_arrays

# Timed calls a measured shape: the fastest counts (see `measure_cost`). Three: the first
# call after a compile and one more outlier can both be slow and still not decide the run.
SAMPLES = 3
# Beside JAX's persistent compile cache: what each program cost to compile and to run.
_COSTS = "polyexec-costs.json"
# MLIR debug locations: `#loc3 = loc(...)` lines and ` loc(#loc3)` / ` loc("x"(#loc))` suffixes.
_LOCATIONS = re.compile(r"^#loc.*$|\s*loc\((?:[^()\n]|\([^()\n]*\))*\)", re.M)


def measure_cost(step: Bucketed, arg: Any, tokens: Any, lengths: Any, *, runs: int = SAMPLES,
                 extra_compiles: Bucketed | None = None, extra_arg: Any = None,
                 parallel: int = 1, on_output: Callable[[Any], None] | None = None,
                 grid: tuple[int, int] | Mapping[str, int] | None = None,
                 then: Sequence[Callable[[], float]] = ()) -> _buckets.CostModel:
    """Compile ``step`` at the shape of ``tokens`` (B, T) and time ``runs`` calls on copies of
    ``arg`` (the step may donate it); the fastest call gives the seconds per padded cell.
    ``tokens`` is the batch the step takes: token ids (B, T), or any pytree of a batch
    (`fit`'s examples stacked), for which ``grid`` is needed.

    The fastest of several (`SAMPLES` in all by default): one timed call is one noisy sample.
    A first call after a compile ran 1.2-1.8x the next two (the pydoc GRU's 8 packed rows of
    1,024 on 2 shared CPU cores: 0.91 and 1.37 s against 0.72-0.76 s), and priced by that
    call alone the example's runs were predicted 1.15-1.33x, once 1.9x, their clock. A slow
    call is noise a faster one reveals; no call runs faster than the step can.

    ``extra_compiles``: a second step compiled at the same shape whose compile seconds are
    added (each length bucket compiles the eval step as well as the train step).
    ``parallel``: the other compiles will overlap this many ways (e.g. beside training on a
    background thread), so count this fraction of their seconds. ``on_output``: called with
    each timed call's output (a real batch's step, kept rather than thrown away). ``grid``:
    the (rows, row length) a packed step runs ``tokens`` at (default: ``tokens.shape``), or
    a step of several lengths' ``{"B": rows, name: size}`` (a cell is a row's cell of any).
    ``then``: more timed calls the caller makes after these (the next real batches, steps
    its run takes anyway), each returning its seconds; the fastest of all counts.

    With JAX's persistent compile cache on, the cost is kept beside it; when the program is
    then loaded from the cache (no compile to time), the kept cost is returned, so a second run
    of the same job chooses the same buckets and finds them all cached.

    >>> import equinox as eqx, jax, numpy as np, optax
    >>> from polyexec.training import TrainState, make_train_step, measure_cost
    >>> loss = lambda model, tokens, lengths: jax.numpy.mean(tokens * model.weight[0, 0])
    >>> step = make_train_step(loss, optax.sgd(0.1), length_buckets=[16], batch_buckets=[4])
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))
    >>> cost = measure_cost(step, state, np.zeros((4, 16), np.int32), np.full(4, 16, np.int32))
    >>> cost.compile_seconds > 0 and cost.seconds_per_cell > 0, step.stats.compiles
    (True, 1)
    """
    if grid is None and not hasattr(tokens, "shape"):
        raise OptionError("measure_cost: grid: expected the (rows, length) a pytree batch runs "
                          "at, received None")
    if isinstance(grid, Mapping):       # several lengths: {"B": rows, name: size, ...}
        shape = dict(grid)
        cells = shape["B"] * sum(v for n, v in shape.items() if n != "B")
    else:
        rows, length = grid if grid is not None else tokens.shape
        shape, cells = {"B": rows, "T": length}, rows * length
    steps = [(step, arg)] + ([(extra_compiles, extra_arg)] if extra_compiles is not None else [])
    seconds, hit = compile_at(steps, shape)
    record = _Record([f for f, _ in steps], shape)

    def call() -> float:
        took, output = _timed_step(step, arg, tokens, lengths)
        if on_output is not None:
            on_output(output)
        return took

    if hit and record.known is not None:
        # Loaded from the persistent cache: the load is no compile. The cost measured when it
        # was compiled stands in -- and so the same job chooses the same, cached, buckets. A
        # caller's real batch still runs once: its output is a step the run needs anyway.
        compile_s, per_cell = record.known
        if on_output is not None:
            call()
    else:
        if runs < 1 and not then:
            raise OptionError(f"measure_cost: runs: expected an int >= 1 (or calls in then), "
                              f"received {runs!r}")
        fastest = min([call() for _ in range(runs)] + [more() for more in then])
        compile_s, per_cell = seconds, fastest / cells
        if not hit:
            record.save(compile_s, per_cell)
    return _buckets.CostModel(compile_seconds=compile_s / parallel, seconds_per_cell=per_cell)


def _timed_step(step: Bucketed, arg: Any, tokens: Any, lengths: Any) -> tuple[float, Any]:
    """``(seconds, output)`` of one call of a compiled ``step`` on a copy of ``arg`` (the step
    may donate it; the caller keeps ``arg``'s owner, a step's output, whole)."""
    fresh = jax.block_until_ready(copy_arrays(arg))
    start = time.perf_counter()
    output = jax.block_until_ready(step(fresh, tokens, lengths))
    return time.perf_counter() - start, output


def compile_at(steps: Sequence[tuple[Bucketed, Any]], shape: dict) -> tuple[float, bool]:
    """Compile each ``(step, arg)`` at ``shape`` (``{"B": rows, "T": length}``): ``(compile
    seconds, whether the persistent cache supplied them)``."""
    before = [f.stats.compile_seconds for f, _ in steps]
    with count_compiles() as events:
        for f, a in steps:
            f.warmup(a, sizes=[shape], max_workers=1)
    return (sum(f.stats.compile_seconds - b for (f, _), b in zip(steps, before)),
            events.cache_hits > 0)


class _Record:
    """The cost measured for one program at one shape, kept beside JAX's persistent compile
    cache (when one is configured) in ``polyexec-costs.json``."""

    def __init__(self, steps: list[Bucketed], shape: dict):
        self.folder = jax.config.jax_compilation_cache_dir
        self.key = None
        # A packed step's program is its packed rewrite: its cost is not the padded one's.
        modules = [f.exported_program() for f in steps]
        if self.folder and None not in modules:
            # Without debug locations: they name the caller's file and line, so the same
            # program traced from another line (or an edited script) would miss its record
            # while JAX's own cache, which ignores them, still hits -- and a load would be
            # timed as if it were a compile.
            text = "".join(_LOCATIONS.sub("", m.mlir_module()) for m in modules)
            text += repr(sorted(shape.items()))
            self.key = hashlib.sha256(text.encode()).hexdigest()

    @property
    def path(self) -> str:
        return os.path.join(self.folder, _COSTS)

    @property
    def known(self) -> tuple[float, float] | None:
        entry = self._read().get(self.key) if self.key else None
        if entry is None:
            return None
        try:
            compile_s, per_cell = (float(v) for v in entry)
        except (TypeError, ValueError):
            compile_s = per_cell = math.nan
        if not (math.isfinite(compile_s) and math.isfinite(per_cell)
                and compile_s >= 0 and per_cell > 0):
            self._damaged(f"its entry for this program is {entry!r}, expected [compile "
                          f"seconds >= 0, seconds per cell > 0]")
            return None
        return compile_s, per_cell

    def _damaged(self, what: str) -> None:
        # The record only saves a measurement: a damaged one is measured again and rewritten,
        # never a reason to stop a run.
        warnings.warn(f"measure_cost: ignoring the cost record {self.path}: {what}; the cost "
                      f"is measured again", stacklevel=4)

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as fh:
                table = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:       # unreadable, or not JSON (UnicodeError too)
            self._damaged(f"{type(e).__name__}: {e}")
            return {}
        if not isinstance(table, dict):
            self._damaged(f"expected a JSON object of program -> cost, received "
                          f"{type(table).__name__} {str(table)[:60]}")
            return {}
        return table

    def save(self, compile_seconds: float, seconds_per_cell: float) -> None:
        if self.key is None:
            return
        table = {**self._read(), self.key: [compile_seconds, seconds_per_cell]}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(table, fh)
            os.replace(tmp, self.path)   # atomic: a concurrent reader sees old or new, whole
        except OSError:
            pass                         # a read-only cache still serves compiles


def agree(cost: _buckets.CostModel, processes: int) -> _buckets.CostModel:
    """Process 0's measurement on every process: each one times its own steps, and the bucket
    choice (hence every step's shape) must be the same everywhere."""
    if processes == 1:
        return cost
    values = multihost_utils.broadcast_one_to_all(
        np.array([cost.compile_seconds, cost.seconds_per_cell, cost.seconds_per_step]))
    return _buckets.CostModel(*(float(v) for v in np.asarray(values)))



@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """What `choose_buckets` chose: the policy (an `Auto` with its ``partial_rows`` and
    ``prediction``), the cost it was chosen by (None for a ``known`` choice), the global
    (rows, length) it was measured at, and the steps at exactly the shapes its batches use.

    ``sizes``: the steps' bucket sizes; ``train_shapes`` / ``eval_shapes``: (rows of one
    process's share, length bucket) -> real
    tokens of one epoch at that shape, for the training lengths and the validation lengths
    (whose partial batches are padded to full rows).
    """

    policy: _buckets.Auto
    cost: _buckets.CostModel | None
    measured_at: tuple[int, int] | None
    steps: tuple[Bucketed, ...]
    sizes: dict                      # {"T": lengths, "B": global rows} the steps were given
    train_shapes: dict
    eval_shapes: dict

    @property
    def prediction(self) -> Any:
        return self.policy.prediction

    def describe(self) -> str:
        """The choice in one line (two with a prediction)."""
        head = (f"T={list(self.policy.sizes)}"
                + (f", partial batches at their own rows for T={list(self.policy.partial_rows)}"
                   if self.policy.partial_rows else ""))
        if self.cost is None:
            return head
        rows, length = self.measured_at
        return (f"measured at B={rows}, T={length}: compile {self.cost.compile_seconds:.2f} s, "
                f"step {self.cost.step_seconds(rows, length):.3f} s: {head}"
                + (f"\n  predicted: {self.prediction.describe()}" if self.prediction else ""))


def rebucket(steps: Sequence[Bucketed], batching: Batching, lengths: np.ndarray,
             validation_lengths: np.ndarray | None = None) -> tuple[tuple[Bucketed, ...], dict,
                                                                    dict, dict]:
    """``steps`` at exactly the (rows, length) shapes ``batching`` makes of ``lengths`` (and,
    partial batches padded to full rows, of ``validation_lengths``); returns (steps, sizes,
    train shapes, eval shapes) as in `BucketChoice`. Rows are global: every process's share."""
    train_shapes = batching.shapes(lengths)
    eval_shapes = (batching.shapes(validation_lengths, partial_rows="full")
                   if validation_lengths is not None else {})
    shapes = (*train_shapes, *eval_shapes)
    sizes = {"T": sorted({t for _, t in shapes}),
             "B": sorted({r * batching.num_shards for r, _ in shapes})}
    return tuple(s.with_buckets(sizes) for s in steps), sizes, train_shapes, eval_shapes


def choose_buckets(step: Bucketed, arg: Any, lengths: Any, *, epochs: int,
                   batch_size: int | None = None, max_tokens: int | None = None,
                   eval_step: Bucketed | None = None, eval_arg: Any = None,
                   validation_lengths: Any = None, known: _buckets.Auto | None = None,
                   min_length: int = 1, parallel: int = 1, pad_id: int = 0,
                   data_parallel: DataParallel | None = None,
                   batch_of: Callable[[int, int], Any] | None = None) -> BucketChoice:
    """Choose the (length x rows) bucket set with the least predicted time, and set the steps'
    buckets to exactly the shapes its batches use.

    Measure (`measure_cost`): compile ``step`` (and ``eval_step``, whose compile seconds are
    added) at the longest length's full batch and time one call on ``arg``; choose
    (`buckets.Auto.fit`) for ``epochs`` passes over ``lengths`` (floored at ``min_length``,
    the step's smallest padded length) with the measured shape counted as already compiled;
    re-bucket (`rebucket`). A longest validation example above every
    chosen size gets one more bucket. ``known``: an earlier choice (a checkpoint's, another
    process's) is re-bucketed as it is, without measuring. ``parallel``: the other compiles
    overlap this many ways (see `measure_cost`). ``data_parallel``: the run's devices
    (`data_parallel`): rows are a multiple of the local devices, every process plans its share,
    and process 0's measurement is used everywhere. ``batch_of``: ``(rows, length) -> the
    batch`` the measurement runs (a `BatchForm`'s ``zeros``); default token ids of ``pad_id``.

    >>> import equinox as eqx, jax, numpy as np, optax
    >>> from polyexec.training import TrainState, choose_buckets, make_train_step
    >>> loss = lambda model, tokens, lengths: jax.numpy.mean(tokens * model.weight[0, 0])
    >>> step = make_train_step(loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4])
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))
    >>> lengths = np.array([3, 5, 6, 7, 40, 41, 64, 9] * 4)
    >>> choice = choose_buckets(step, state, lengths, epochs=3, batch_size=4)
    >>> choice.policy.sizes[-1], choice.steps[0].bucket_sizes("T") == choice.policy.sizes
    (64, True)
    """
    dp = data_parallel
    shards, shard, multiple = ((dp.processes, dp.process_index, dp.local_devices)
                               if dp is not None else (1, 0, 1))
    lengths = np.asarray(lengths)
    val = np.asarray(validation_lengths) if validation_lengths is not None else None
    top = max(int(lengths.max()), int(val.max()) if val is not None and val.size else 0,
              min_length)
    batching = Batching(_buckets.Fixed([top]), batch_size, max_tokens, False, 0,
                        min_length=min_length, device_multiple=multiple, num_shards=shards,
                        shard_index=shard)
    rows = batching.rows(top)
    cost = measured_at = None
    if known is not None:
        policy = known
    else:
        batch = (batch_of(rows, top) if batch_of is not None
                 else np.full((rows, top), pad_id, np.int32))
        full = np.full(rows, top, np.int32)
        place = dp.global_batch if dp is not None else (lambda x: x)
        cost = measure_cost(step, arg, place(batch), place(full), extra_compiles=eval_step,
                            extra_arg=eval_arg, parallel=parallel, grid=(rows * shards, top))
        cost = agree(cost, shards)
        measured_at = (rows * shards, top)
        policy = _buckets.Auto.fit(np.maximum(lengths, min_length), cost, epochs=epochs,
                                   batch_size=batch_size,
                                   max_tokens=max_tokens, num_shards=shards,
                                   row_multiple=multiple, compiled=[(rows, top)])
    if val is not None and val.size and int(val.max()) > policy.largest:
        # Kept as an Auto with the validation-only bucket: passing it back as buckets= repeats
        # this choice's batches exactly, partial rows included.
        policy = _buckets.Auto((*policy.sizes, int(val.max())), policy.partial_rows,
                               policy.prediction)
    batching = dataclasses.replace(batching, policy=policy)
    steps = (step,) + ((eval_step,) if eval_step is not None else ())
    steps, sizes, train_shapes, eval_shapes = rebucket(steps, batching, lengths, val)
    return BucketChoice(policy, cost, measured_at, steps, sizes, train_shapes, eval_shapes)


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """What `choose_layout` chose: ``layout`` ("pad" or "pack") and why; ``step``, the train
    step pinned to it; for pad, ``buckets`` (the `BucketChoice`); for pack, the
    ``row_lengths`` and ``pack_rows`` (rows a step per row length); the cost they were
    priced by, where it was measured, and both predictions (``pack`` is None when the plan
    cannot pack). ``first_steps``: a packed choice's measured calls on real batches
    (``examples`` given), in the order they ran, each ``(its buckets.PackedBatch, the step's
    output)``, the second on the first's output: the run's first steps, which `epoch_plan`
    puts first and plans the rest of the epoch without."""

    layout: str
    reason: str
    step: Bucketed
    buckets: BucketChoice | None
    row_lengths: tuple[int, ...] = ()
    pack_rows: dict = dataclasses.field(default_factory=dict)
    cost: _buckets.CostModel | None = None
    measured_at: tuple[int, int] | None = None
    pad: _buckets.Prediction | None = None
    pack: _buckets.Prediction | None = None
    first_steps: tuple[tuple[_buckets.PackedBatch, Any], ...] = ()
    eval_step: Bucketed | None = None       # packed like ``step`` (a padded choice: in buckets)
    # Packed: the cells every example takes after its own (the steps' `Plan.packing_room`):
    # every plan of packed steps counts them, as the executor does.
    room: int = 0
    # Packed: the cells of a step the steps are planned with (``rows x length`` at every row
    # length); ``pack_rows`` may hold more rows, rounded up to the devices (`PackedBatching`).
    budget: int | None = None

    @property
    def prediction(self) -> _buckets.Prediction | None:
        return self.pack if self.layout == "pack" else self.pad

    @property
    def max_tokens(self) -> int | None:
        """Packed: the cells of a step, the same at every row length (``rows x length``), for
        `buckets.packed_batch_plan`'s ``max_tokens``."""
        return self.budget or max((n * r for n, r in self.pack_rows.items()), default=None)

    def epoch_plan(self, lengths: Any, *, epoch: int, seed: int = 0
                   ) -> list[_buckets.PackedBatch]:
        """A packed choice's steps for one epoch over ``lengths`` (those it was chosen on):
        in epoch 0 the measured batches (`first_steps`) first, then
        `buckets.packed_batch_plan` of every other example; in later epochs that plan of all."""
        done = [b for b, _ in self.first_steps] if epoch == 0 else []
        return done + _buckets.packed_batch_plan(
            lengths, self.row_lengths, max_tokens=self.max_tokens, seed=seed, epoch=epoch,
            exclude=np.concatenate([b.indices for b in done]) if done else (), room=self.room)

    def describe(self) -> str:
        """The choice and its reason, with the buckets (pad) or rows (pack) chosen."""
        if self.layout == "pack":
            rows = ", ".join(f"{r} rows of {n}" for n, r in sorted(self.pack_rows.items()))
            return f"layout pack ({rows}): {self.reason}"
        return f"layout pad: {self.reason}\n  {self.buckets.describe()}"


def _versus(pack: _buckets.Prediction, pad: _buckets.Prediction, epochs: int) -> str:
    return (f"predicted {pack.seconds:.1f} s packed ({pack.steps // epochs} steps an epoch, "
            f"{pack.compiles} compiles, padding efficiency {pack.padding_efficiency:.3f}) "
            f"against {pad.seconds:.1f} s padded ({pad.steps // epochs} steps an epoch, "
            f"{pad.compiles} compiles, {pad.padding_efficiency:.3f})")


def _packing(step: Bucketed, row_lengths: tuple[int, ...], pack_rows: dict) -> Bucketed:
    """``step`` packing into exactly ``row_lengths``: a batch runs at the smallest one that
    holds its longest example (`buckets.packed_batch_plan`'s row length for it)."""
    return step.with_buckets({"T": list(row_lengths)}).with_layout("pack", pack_rows)


def choose_layout(step: Bucketed, arg: Any, lengths: Any, *, epochs: int,
                  batch_size: int | None = None, max_tokens: int | None = None,
                  layout: str = "auto", seed: int = 0, min_length: int = 1, parallel: int = 1,
                  pad_id: int = 0, known: dict | None = None,
                  examples: Callable[[np.ndarray], tuple[Any, Any]] | None = None,
                  next_arg: Callable[[Any], Any] | None = None,
                  eval_step: Bucketed | None = None, eval_arg: Any = None,
                  validation_lengths: Any = None, data_parallel: DataParallel | None = None,
                  batch_of: Callable[[int, int], Any] | None = None) -> LayoutChoice:
    """Pad or pack, by predicted run time; ``step`` is a train step made with
    ``layout="auto"`` (so its one trace holds the packed program too).

    A plan that can pack is compiled once and timed (the fastest of `SAMPLES` calls: real
    batches' steps with ``examples``, else padding) at its packed shape -- rows
    of the longest length ``L``, as few as hold about ``batch_size`` examples a step
    (`_rows_holding`: the padded layout's steps an epoch), or ``max_tokens // L`` (the same
    cells a step as padded rows) -- and that cost
    prices both layouts for ``epochs`` epochs: packed rows by `buckets.predict_packed` (the
    very plans `buckets.packed_batch_plan` makes), one sequence a row by `buckets.Auto.fit`
    (its best bucket set). The cheaper wins (``layout="pack"`` packs regardless); the
    measured compile is the packed run's only one. (A padded set with no compile cost has
    fewer cells than the packed rows on the pydoc corpus -- 282 buckets -- so counts alone
    never decide: the compile has to be timed.)
    A plan that cannot pack, or ``layout="pad"``, goes to `choose_buckets` as before.
    ``known``: an earlier choice's ``{"layout", "row_lengths", "pack_rows"}``, repeated
    without measuring (a padded one passes its policy to `choose_buckets` instead).
    ``examples``: example indices -> their ``(tokens, lengths)``, and ``next_arg``: a step's
    output -> the next step's argument (the trained state). Given, the timed calls run real
    batches of epoch 0 (``buckets.packed_batch_plan(lengths, row_lengths, ..., seed=seed)``),
    one after another from ``arg``, rather than throwaway ones: a packed choice keeps them all
    (``first_steps``), whichever row lengths it takes, and the run goes on from the last.
    Shorter rows compile alone, not beside training steps: on 2 CPU cores a GRU step and an
    XLA compile each keep both busy, and overlapping them took 1-2 s longer than one after
    the other.
    ``eval_step`` (on ``eval_arg``), ``validation_lengths``, ``data_parallel``, ``batch_of``:
    as for `choose_buckets`; packed rows are the global grid's (``batch_size`` and
    ``max_tokens`` per process, as padded), a multiple of all the run's devices, which split
    them whole (the steps are planned at the rows a budget holds, the grid rounded up to a
    multiple of the devices with empty rows: the same steps at any process count), and
    process 0's timings decide on every process; a packed choice packs the eval step into the same rows
    (``LayoutChoice.eval_step``), and an eval step that cannot pack makes the run pad.

    >>> import equinox as eqx, jax, numpy as np, optax
    >>> from polyexec.training import TrainState, choose_layout, make_train_step
    >>> loss = lambda model, tokens, lengths: jax.numpy.sum(tokens * model.weight[0, 0])
    >>> step = make_train_step(loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4],
    ...                        layout="auto")
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))
    >>> lengths = np.array([3, 5, 6, 7, 40, 41, 64, 9] * 4)
    >>> choice = choose_layout(step, state, lengths, epochs=3, batch_size=4)
    >>> choice.layout, choice.pack_rows, choice.pack.compiles, step.stats.compiles
    ('pack', {64: 2}, 0, 1)
    >>> choice.pack.steps // 3, choice.pad.steps // 3     # optimiser steps an epoch: about 32 / 4
    (7, 8)
    """
    if layout not in ("auto", "pad", "pack"):
        raise OptionError(f"choose_layout: layout: expected one of 'auto', 'pad', 'pack', "
                          f"received {layout!r}")
    if (examples is None) != (next_arg is None):
        raise OptionError(f"choose_layout: examples and next_arg: expected both or neither, "
                          f"received only {'examples' if next_arg is None else 'next_arg'}")
    lengths = np.maximum(np.asarray(lengths), min_length)

    def padded(reason: str, policy: _buckets.Auto | None = None,
               pack: _buckets.Prediction | None = None, cost=None, measured_at=None):
        chosen = choose_buckets(step.with_layout("pad"), arg, lengths, epochs=epochs,
                                batch_size=batch_size, max_tokens=max_tokens, known=policy,
                                min_length=min_length, parallel=parallel, pad_id=pad_id,
                                eval_step=(eval_step.with_layout("pad")
                                           if eval_step is not None else None),
                                eval_arg=eval_arg, validation_lengths=validation_lengths,
                                data_parallel=data_parallel, batch_of=batch_of)
        return LayoutChoice("pad", reason, chosen.steps[0], chosen, cost=chosen.cost or cost,
                            measured_at=chosen.measured_at or measured_at,
                            pad=chosen.prediction, pack=pack)

    if known is not None and known.get("layout") == "pad":
        return padded("as chosen before", known.get("policy"))
    if layout == "pad":
        return padded("layout='pad' was asked for")
    room = 0
    for name, f, on in ((step.name, step, arg), ("the eval step", eval_step, eval_arg)):
        plan = f.plan_for(on) if f is not None else None
        if plan is not None and not plan.can_pack:
            if layout == "pack":
                warnings.warn(f"choose_layout: {name} cannot run packed rows, so it runs one "
                              f"sequence per padded row: {plan.packing_reason}", stacklevel=2)
            return padded(f"{name} cannot pack: {plan.packing_reason}")
        # One plan of steps serves both (`PackedBatching`): it leaves the larger room.
        room = max(room, plan.packing_room if plan is not None else 0)

    def packed_eval(row_lengths, pack_rows):
        return _packing(eval_step, row_lengths, pack_rows) if eval_step is not None else None

    if known is not None:
        pack_rows = {int(k): int(v) for k, v in known["pack_rows"].items()}
        row_lengths = tuple(int(n) for n in known["row_lengths"])
        return LayoutChoice("pack", "as chosen before", _packing(step, row_lengths, pack_rows),
                            None, row_lengths, pack_rows,
                            eval_step=packed_eval(row_lengths, pack_rows), room=room,
                            budget=known.get("max_tokens"))
    row_length = step.bucket_for("T", int(lengths.max()))
    # Packed rows are global: every process plans the same steps, each of one grid whose rows
    # are split over every device of the run, whole rows each (a multiple of them), and
    # ``batch_size`` / ``max_tokens`` are per process, as padded.
    dp = data_parallel
    shards, devices, local = (dp.processes, dp.size, dp.local_devices) if dp else (1, 1, 1)
    # The steps are planned at ``rows`` (so at any process count the same), the grid rounds
    # them up to the devices with empty rows.
    rows = (_rows_holding(lengths, row_length, batch_size * shards, seed, room)
            if batch_size is not None else max(1, max_tokens * shards // row_length))
    budget = rows * row_length
    pack_rows = {row_length: round_up(rows, devices)}
    packer = _packing(step, (row_length,), pack_rows)
    short = _shorter_length(lengths, row_length, min_length)
    # The plans whose first batches the timed calls run: the two-length one's (a long batch
    # of it is as much a (rows, row_length) step as the one-length plan's), else that one's.
    plans = []
    if examples is not None:
        plans = [_buckets.packed_batch_plan(lengths, n, max_tokens=budget, seed=seed, room=room)
                 for n in ([short, row_length], [row_length]) if None not in n]
    first_steps, on = [], arg

    def unrun(row_length):
        """The batches of ``row_length`` not yet run, all of one plan: the batches a choice
        keeps must not share an example."""
        ran = {id(b) for b, _ in first_steps}
        for plan in plans:
            found = [b for b in plan if b.row_length == row_length and id(b) not in ran]
            if found:
                return found
        return []

    def timed(packer, grid):
        """Compile ``packer`` and time `SAMPLES` calls at ``grid`` (rows, row length), the
        fastest counting (`measure_cost`): when ``examples`` are given, on the first batches
        of that row length in ``plans`` not yet run, each kept in ``first_steps`` and each
        call on the last one's output (steps the run takes anyway: free samples); padding
        makes up the rest (a plan with fewer such batches; all of them without ``examples``,
        as `fit` measures), its outputs dropped."""
        batches = unrun(grid[1])[:SAMPLES]
        padding = (batch_of(*grid) if batch_of is not None else np.full(grid, pad_id, np.int32),
                   np.full(grid[0], grid[1], np.int32))

        def keep(output):
            nonlocal on
            first_steps.append((batches[len(first_steps) - ran_before], output))
            on = next_arg(output)

        def real(batch) -> Callable[[], float]:      # a next batch, on the last one's output
            def call() -> float:
                took, output = _timed_step(packer, on, *examples(batch.indices))
                keep(output)
                return took
            return call

        def pad() -> float:
            return _timed_step(packer, on, *padding)[0]

        ran_before = len(first_steps)
        if batches:
            then = [real(b) for b in batches[1:]] + [pad] * (SAMPLES - len(batches))
            cost = measure_cost(packer, on, *examples(batches[0].indices), runs=1,
                                parallel=parallel, on_output=keep, grid=grid, then=then)
        else:
            cost = measure_cost(packer, on, *padding, runs=SAMPLES, parallel=parallel,
                                grid=grid)
        # Every process runs its rows of the same grid; process 0's timing decides for all.
        return agree(cost, shards)

    grid = (pack_rows[row_length], row_length)
    cost = timed(packer, grid)
    pack = _buckets.predict_packed(lengths, [row_length], cost, epochs=epochs, rows=rows,
                                   seed=seed, compiled=[grid], room=room)
    # The padded steps would compile every shape, the longest included (not yet compiled).
    pad_policy = _buckets.Auto.fit(lengths, cost, epochs=epochs, batch_size=batch_size,
                                   max_tokens=max_tokens, num_shards=shards, row_multiple=local)
    row_lengths = (row_length,)
    shorter = (_shorter_rows(step, lengths, short, row_length, rows, cost, pack, epochs, seed,
                             parallel, timed, devices, room) if short is not None else None)
    if shorter is not None:
        pack, pack_rows = shorter
        row_lengths = tuple(sorted(pack_rows))
        packer = _packing(step, row_lengths, pack_rows)
    versus = _versus(pack, pad_policy.prediction, epochs)
    if layout == "auto" and pad_policy.prediction.seconds < pack.seconds:
        return padded(versus, pad_policy, pack, cost, grid)
    return LayoutChoice("pack", versus if layout == "auto" else "layout='pack' was asked for",
                        packer, None, row_lengths, pack_rows, cost, grid,
                        pad_policy.prediction, pack, tuple(first_steps),
                        packed_eval(row_lengths, pack_rows), room, budget)


def _rows_holding(lengths, row_length: int, batch_size: int, seed: int, room: int) -> int:
    """The fewest rows of ``row_length`` a packed step needs so that an epoch takes no more
    steps than ``batch_size`` examples a step would (``ceil(N / batch_size)``): ``batch_size``
    keeps its meaning -- about that many examples an optimiser step -- in either layout,
    where ``batch_size`` rows of the longest length would hold many times more (fewer, larger
    steps: a worse loss after the same epochs). Counted on epoch 0's very plan."""
    target = -(-len(lengths) // batch_size)
    lo, hi = 1, max(1, batch_size)
    while lo < hi:                  # first-fit steps fall as rows grow (near enough: bisect)
        mid = (lo + hi) // 2
        steps = len(_buckets.packed_batch_plan(lengths, [row_length], rows=mid, seed=seed,
                                               room=room))
        lo, hi = (lo, mid) if steps <= target else (mid + 1, hi)
    return lo


def _shorter_length(lengths, row_length: int, min_length: int) -> int | None:
    """The shorter row length `_shorter_rows` would try beside ``row_length``: the smallest of
    ``row_length / 2, / 4, / 8`` that holds half the tokens (None: none does)."""
    total = float(lengths.sum())
    candidates = [row_length // k for k in (8, 4, 2) if row_length // k >= max(min_length, 2)]
    return next((n for n in candidates if total and lengths[lengths <= n].sum() >= total / 2),
                None)


def _shorter_rows(step, lengths, short, row_length, rows, cost, single, epochs, seed, parallel,
                  timed, multiple=1, room=0):
    """Packed rows of two lengths, ``short`` (`_shorter_length`) beside ``row_length`` at the
    same tokens a step: ``(prediction, pack_rows)`` when that is predicted faster than
    ``single`` (the one row length's prediction), else None. ``timed`` is `choose_layout`'s
    measurement.

    A cell of a short row can cost less than one of a long row -- four times the rows a step
    keep the cores busier beside an RNN's sequential steps (22 against 30 us a token on 2 CPU
    cores) -- which only a measurement shows, at the price of one more compile. The short
    rows are compiled and timed only when the two-length plan (its own padding counted) would
    gain more than that costs, were its cells a quarter cheaper (the most measured: 26%; a
    short run that cannot gain skips it). The long rows' free cells take short examples
    (`buckets.packed_batch_plan`'s backfill), so the two lengths pad no more than one."""
    budget = rows * row_length
    short_rows = max(1, budget // short)
    # The grids, rounded up to the devices (`PackedBatching.pack_rows`); the plan is not.
    shapes = [(round_up(rows, multiple), row_length), (round_up(short_rows, multiple), short)]
    cheaper = dataclasses.replace(cost, seconds_per_cell=cost.seconds_per_cell * 0.75)
    best = _buckets.predict_packed(lengths, [short, row_length],
                                   {short: cheaper, row_length: cost}, epochs=epochs,
                                   max_tokens=budget, seed=seed, compiled=shapes, room=room)
    # Priced in full (`parallel` discounts only compiles that overlap training): it blocks.
    if (single.seconds - best.seconds
            <= cost.compile_seconds * parallel + cost.step_seconds(*shapes[1])):
        return None
    short_cost = timed(_packing(step, (short,), {short: shapes[1][0]}), shapes[1])
    pack_rows = {short: shapes[1][0], row_length: shapes[0][0]}
    both = _buckets.predict_packed(lengths, [short, row_length],
                                   {short: short_cost, row_length: cost}, epochs=epochs,
                                   max_tokens=budget, seed=seed, compiled=shapes, room=room)
    return (both, pack_rows) if both.seconds < single.seconds else None
