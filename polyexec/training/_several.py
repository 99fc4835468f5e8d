"""`fit` over examples of several lengths (an encoder-decoder's ``{"src": (S,), "tgt": (T,)}``):
their padded and packed batch plans, and the choice between them by predicted time.

Padded, a batch's examples share a bucket of every length (`JointBatching`: one compiled
shape per bucket combination in use). Packed, an example's sequences go into the same row of
every length's grid, rows of each length's longest (`JointPackedBatching`: one compiled
shape), planned by the executor's own first-fit (`buckets.joint_first_fit`), so a
planned step is the grid that runs. `choose_several` measures one step and prices both.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

import buckets as _buckets

from .. import Bucketed
from .._errors import OptionError, check_int, is_int
from ._auto import measure_cost
from ._data import Examples, pad_batch, round_up


class JointBatch(NamedTuple):
    """One step of a several-length plan: the size it runs each length at (the form's order),
    its examples, and its rows."""

    sizes: tuple[int, ...]
    indices: np.ndarray
    rows: int


class _JointSteps:
    """What both several-length batchings share: a step's shape ``(rows, *sizes)``, an
    epoch's shapes, and stacking a step's examples."""

    min_length: int

    def shape(self, batch: JointBatch) -> tuple[int, ...]:
        return (batch.rows, *batch.sizes)

    def shapes(self, sizes: np.ndarray, partial_rows: Any = None) -> dict[tuple[int, ...], int]:
        """Every ``(rows, *sizes)`` an epoch runs at, and the real tokens each carries."""
        out: dict[tuple[int, ...], int] = {}
        for batch in self.epoch(sizes, 0, shuffle=False):
            out[self.shape(batch)] = (out.get(self.shape(batch), 0)
                                      + int(np.asarray(sizes)[batch.indices].sum()))
        return out

    def stack(self, examples: Examples, batch: JointBatch) -> tuple[Any, Any]:
        """The step's examples stacked at its own longest of each length (at least
        ``min_length``); the executor pads them to the bucket, or packs them."""
        longest = np.maximum(examples.sizes[batch.indices].max(axis=0), self.min_length)
        return pad_batch(examples, batch.indices, len(batch.indices),
                         {n: int(m) for n, m in zip(examples.form.lengths, longest)})


@dataclasses.dataclass(frozen=True)
class JointBatching(_JointSteps):
    """Padded batches of examples of several lengths: an example's bucket of each length is
    its ``policies`` entry's, and a batch's examples share all of them, ``batch_size`` rows
    (or the largest power of two with ``rows x (the sum of the sizes) <= max_tokens``); a
    bucket combination's last batch is padded to full rows (``exact_rows``: just its own).
    Shuffled within each combination and across steps, deterministic in (seed, epoch).

    >>> import buckets, numpy as np
    >>> b = JointBatching(("S", "T"), (buckets.Fixed([4, 8]), buckets.Fixed([4])), 2, None,
    ...                   shuffle=False, seed=0)
    >>> [(s.sizes, s.indices.tolist(), s.rows) for s in b.epoch(np.array([[3, 2], [7, 4], [2, 1]]), 0)]
    [((4, 4), [0, 2], 2), ((8, 4), [1], 2)]
    """

    names: tuple[str, ...]
    policies: tuple[Any, ...]
    batch_size: int | None
    max_tokens: int | None
    shuffle: bool
    seed: int
    min_length: int = 2
    device_multiple: int = 1
    exact_rows: bool = False

    @property
    def length_buckets(self) -> dict[str, list[int]]:
        return {n: list(p.sizes) for n, p in zip(self.names, self.policies)}

    @property
    def policy(self) -> dict[str, Any]:
        """Each length's policy: ``fit(buckets=...)`` repeats the buckets with it."""
        return dict(zip(self.names, self.policies))

    def known(self) -> dict:
        """What a checkpoint keeps of this choice, for `choose_several`'s ``known``."""
        return {"layout": "pad", "sizes": self.length_buckets}

    def examples_for(self, sizes: tuple[int, ...]) -> int:
        """The examples of a full batch at ``sizes``."""
        return (self.batch_size if self.batch_size is not None else
                _buckets.batch_size_for(sum(sizes), self.max_tokens))

    def rows_for(self, sizes: tuple[int, ...]) -> int:
        """Its rows: a multiple of the devices (filled with rows of no example), as padded
        batches of one length."""
        return round_up(self.examples_for(sizes), self.device_multiple)

    def epoch(self, sizes: np.ndarray, epoch: int, *, shuffle: bool | None = None,
              partial_rows: Any = None) -> list[JointBatch]:
        sizes = np.maximum(np.asarray(sizes), self.min_length)
        keys = [tuple(int(p.bucket_for(int(n))) for p, n in zip(self.policies, row))
                for row in sizes]
        shuffle = self.shuffle if shuffle is None else shuffle
        rng = (np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
               if shuffle else None)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        steps = []
        for key in sorted(groups):
            pool = np.asarray(groups[key], np.int64)
            if rng is not None:
                pool = rng.permutation(pool)
            take, rows = self.examples_for(key), self.rows_for(key)
            for start in range(0, pool.size, take):
                part = pool[start:start + take]
                steps.append(JointBatch(key, part, round_up(part.size, self.device_multiple)
                                        if self.exact_rows else rows))
        if rng is not None and len(steps) > 1:
            steps = [steps[i] for i in rng.permutation(len(steps))]
        return steps


@dataclasses.dataclass(frozen=True)
class JointPackedBatching(_JointSteps):
    """Packed steps of examples of several lengths: rows ``row_lengths`` long (one per length,
    the form's order), ``rows`` a step, an example's sequences in the same row of every
    length's grid. A step takes examples in a shuffled order while the executor's own
    first-fit (`buckets.joint_first_fit`, each sequence taking its cells and ``rooms``' after it)
    holds them in ``rows``, so the grid that runs is the one planned; the grid rounds its rows
    up to ``row_multiple`` (the devices, which split them whole).

    >>> b = JointPackedBatching(("S", "T"), (8, 4), 2, shuffle=False, seed=0)
    >>> [s.indices.tolist() for s in b.epoch(np.array([[5, 2], [3, 2], [6, 3], [2, 1]]), 0)]
    [[0, 1, 2], [3]]
    """

    names: tuple[str, ...]
    row_lengths: tuple[int, ...]
    rows: int
    shuffle: bool
    seed: int
    min_length: int = 2
    rooms: tuple[int, ...] = ()
    row_multiple: int = 1

    @property
    def length_buckets(self) -> dict[str, list[int]]:
        return {n: [L] for n, L in zip(self.names, self.row_lengths)}

    @property
    def policy(self) -> dict[str, Any]:
        return {n: _buckets.Fixed([L]) for n, L in zip(self.names, self.row_lengths)}

    def known(self) -> dict:
        """What a checkpoint keeps of this choice, for `choose_several`'s ``known``."""
        return {"layout": "pack", "row_lengths": list(self.row_lengths), "rows": self.rows,
                "rooms": list(self.rooms)}

    @property
    def pack_rows(self) -> dict[int, int]:
        """The step's ``pack_rows``: the executor keys them by the row length of the first
        packed variable (in sorted order)."""
        first = self.names.index(min(self.names))
        return {self.row_lengths[first]: round_up(self.rows, self.row_multiple)}

    def _room(self, v: int) -> int:
        return self.rooms[v] if self.rooms else 0

    def epoch(self, sizes: np.ndarray, epoch: int, *, shuffle: bool | None = None,
              partial_rows: Any = None) -> list[JointBatch]:
        raw = np.asarray(sizes, np.int64)
        sizes = np.maximum(raw, self.min_length)
        rooms = np.array([self._room(v) for v in range(len(self.names))], np.int64)
        need = sizes + rooms
        width = np.array([L + self._room(v) for v, L in enumerate(self.row_lengths)], np.int64)
        over = np.argwhere(need > width)
        if over.size:
            i, v = (int(x) for x in over[0])
            raise OptionError(f"fit: data[{i}]: length {self.names[v]} = {int(sizes[i, v])} "
                              f"is over the packed rows of {self.row_lengths[v]}")
        shuffle = self.shuffle if shuffle is None else shuffle
        order = (np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                 .permutation(len(sizes)) if shuffle else np.arange(len(sizes)))
        steps: list[list[int]] = []
        free = np.tile(width, (self.rows, 1))
        current: list[int] = []
        for i in order:
            fits = (free >= need[i]).all(axis=1)
            if not fits.any():              # full: the step closes, this example opens one
                steps.append(current)
                current, free = [], np.tile(width, (self.rows, 1))
                fits = (free >= need[i]).all(axis=1)
            free[int(np.argmax(fits))] -= need[i]
            current.append(int(i))
        if current:
            steps.append(current)
        # Checked with the cells the executor packs: each sequence's own length and room.
        planned = [part for step in steps for part in self._held(step, raw + rooms, width)]
        grid = (round_up(self.rows, self.row_multiple), *self.row_lengths)
        return [JointBatch(grid[1:], np.asarray(p, np.int64), grid[0]) for p in planned]

    def _held(self, step: list[int], need: np.ndarray, width: np.ndarray) -> list[list[int]]:
        """``step`` as the executor packs it (biggest first): in ``rows`` rows, or split until
        each part is (arrival order's first-fit can hold what biggest-first does not)."""
        cells = {n: need[step, v] for v, n in enumerate(self.names)}
        _, _, used = _buckets.joint_first_fit(cells, dict(zip(self.names, width.tolist())))
        if used <= self.rows or len(step) == 1:
            return [step]
        half = len(step) // 2
        return self._held(step[:half], need, width) + self._held(step[half:], need, width)


@dataclasses.dataclass(frozen=True)
class SeveralChoice:
    """What `choose_several` chose: ``layout`` and why, the batching and the steps pinned to
    it, the cost both layouts were priced by (None: repeated from a checkpoint without
    measuring) and both predictions (``pack`` None where the steps cannot pack)."""

    layout: str
    reason: str
    batching: JointBatching | JointPackedBatching
    step: Bucketed
    eval_step: Bucketed | None
    cost: _buckets.CostModel | None = None
    pad: _buckets.Prediction | None = None
    pack: _buckets.Prediction | None = None

    @property
    def prediction(self) -> _buckets.Prediction | None:
        return self.pack if self.layout == "pack" else self.pad

    def describe(self) -> str:
        b = self.batching
        if self.layout == "pack":
            rows = ", ".join(f"{n}: {L}" for n, L in zip(b.names, b.row_lengths))
            return f"pack ({next(iter(b.pack_rows.values()))} rows of {rows}): {self.reason}"
        return (f"pad (buckets {', '.join(f'{n}={s}' for n, s in b.length_buckets.items())}): "
                f"{self.reason}")


def predicted(batching: JointBatching | JointPackedBatching, sizes: np.ndarray,
              cost: _buckets.CostModel, epochs: int,
              compiled: frozenset = frozenset()) -> _buckets.Prediction:
    """``batching``'s run of ``epochs`` over ``sizes`` priced by ``cost``: its steps' cells
    (rows x the sum of the sizes) and one compile per shape not in ``compiled``. The steps
    are the epochs' own plans (packed, a shuffled order packs a little differently each
    epoch), the first four of them, a longer run priced at their mean."""
    planned = [batching.epoch(sizes, e) for e in range(min(epochs, 4))]
    scale = epochs / len(planned)
    steps = [b for plan in planned for b in plan]
    shapes = sorted({batching.shape(b) for b in steps})
    step_s = scale * sum(cost.step_seconds(b.rows, sum(b.sizes)) for b in steps)
    compiles = sum(s not in compiled for s in shapes)
    compile_s = compiles * cost.compile_seconds
    cells = round(scale * sum(b.rows * sum(b.sizes) for b in steps))
    return _buckets.Prediction(compile_s + step_s, compile_s, step_s, compiles,
                               round(scale * len(steps)), cells, epochs * int(sizes.sum()),
                               tuple(shapes))


def _rows_holding(batching: JointPackedBatching, sizes: np.ndarray, batch_size: int) -> int:
    """The fewest rows a packed step needs for an epoch of no more steps than ``batch_size``
    examples a step would take (as `_auto._rows_holding` for one length)."""
    target = -(-len(sizes) // batch_size)
    lo, hi = 1, max(1, batch_size)
    while lo < hi:
        mid = (lo + hi) // 2
        steps = len(dataclasses.replace(batching, rows=mid).epoch(sizes, 0))
        lo, hi = (lo, mid) if steps <= target else (mid + 1, hi)
    return lo


def choose_several(step: Bucketed, arg: Any, examples: Examples, *, epochs: int,
                   batch_size: int | None, max_tokens: int | None, layout: str = "auto",
                   seed: int = 0, shuffle: bool = True, min_length: int = 2,
                   devices: int = 1, exact_rows: bool = False,
                   eval_step: Bucketed | None = None, eval_arg: Any = None,
                   validation: Examples | None = None, known: Mapping | None = None,
                   measure: Callable[..., _buckets.CostModel] | None = None) -> SeveralChoice:
    """Pad or pack examples of several lengths, by predicted time over ``epochs``; ``step``
    (and ``eval_step``) made with ``layout="auto"`` or ``"pad"``.

    Packed rows are each length's longest (training and validation), as few a step as hold
    about ``batch_size`` examples (an epoch of as many optimiser steps as padded), or
    ``max_tokens // (the sum of the row lengths)``. Padded buckets are each length's
    ``buckets.Optimal`` fit of 1 to 4 sizes, the combination with the least predicted time.
    One step is compiled and timed by ``measure`` (default `measure_several`) -- packed where
    the plan can pack, else padded at the longest bucket of each length -- and its seconds
    per cell price both layouts. ``known``: a checkpoint's record of a batching (its ``known()``), repeated
    without measuring.
    """
    names = examples.form.lengths
    raw = examples.sizes                 # what the run plans from (each plan floors it)
    sizes = np.maximum(raw, min_length)
    # Every example a step may run (the eval step's batches too): the bounds and the rows.
    every = sizes if validation is None else np.concatenate(
        [sizes, np.maximum(validation.sizes, min_length)])
    tops = every.max(axis=0)

    def padded(policies) -> JointBatching:
        return JointBatching(names, tuple(policies), batch_size, max_tokens, shuffle, seed,
                             min_length, devices, exact_rows)

    def pinned(f: Bucketed | None, batching, how: str) -> Bucketed | None:
        if f is None:
            return None
        if how == "pack":
            return f.with_buckets(batching.length_buckets).with_layout("pack", batching.pack_rows)
        rows = sorted({b.rows for b in batching.epoch(every, 0, shuffle=False)})
        return f.with_buckets({**batching.length_buckets, "B": rows}).with_layout("pad")

    def chosen(how, reason, batching, cost=None, pad=None, pack=None) -> SeveralChoice:
        return SeveralChoice(how, reason, batching, pinned(step, batching, how),
                             pinned(eval_step, batching, how), cost, pad, pack)

    rooms = []
    can_pack, why = layout != "pad", "layout='pad' was asked for"
    for what, f, on in (("the train step", step, arg), ("the eval step", eval_step, eval_arg)):
        plan = f.plan_for(on) if f is not None and can_pack else None
        if plan is not None and not plan.can_pack:
            can_pack, why = False, f"{what} cannot pack: {plan.packing_reason}"
        elif plan is not None:
            rooms.append([plan.packing_room_of(n) for n in names])
    rooms = tuple(int(r) for r in np.max(rooms, axis=0)) if can_pack and rooms else ()
    if known is not None:
        if known["layout"] == "pack":
            return chosen("pack", "as chosen before", JointPackedBatching(
                names, tuple(known["row_lengths"]), int(known["rows"]), shuffle, seed,
                min_length, tuple(known["rooms"]), devices))
        return chosen("pad", "as chosen before",
                      padded(_buckets.Fixed(known["sizes"][n]) for n in names))
    if layout == "pack" and not can_pack:
        raise OptionError(f"fit: layout='pack': {why}; use layout='auto' or 'pad'")

    def fitted(v: int, k: int) -> Any:
        sizes_v = _buckets.Optimal.fit(sizes[:, v], max_buckets=k).sizes
        return _buckets.Fixed(sorted({*sizes_v, int(tops[v])}))

    combos = [padded(fitted(v, k) for v, k in enumerate(ks))
              for ks in itertools.product(range(1, 5), repeat=len(names))]
    longest = padded(_buckets.Fixed([int(t)]) for t in tops)
    packer = None
    if can_pack:
        packer = JointPackedBatching(names, tuple(int(t) for t in tops), 1, shuffle, seed,
                                     min_length, rooms, devices)
        rows = (_rows_holding(packer, raw, batch_size) if batch_size is not None else
                max(1, max_tokens // int(tops.sum())))
        packer = dataclasses.replace(packer, rows=rows)
        shape = packer.shape(packer.epoch(raw, 0, shuffle=False)[0])
        f, f_eval = pinned(step, packer, "pack"), pinned(eval_step, packer, "pack")
    else:
        shape = (longest.rows_for(tuple(int(t) for t in tops)), *(int(t) for t in tops))
        f, f_eval = pinned(step, longest, "pad"), pinned(eval_step, longest, "pad")
    measure = measure or functools.partial(measure_several, form=examples.form)
    cost = measure(f, arg, examples.form.step_sizes(shape), extra=f_eval, extra_arg=eval_arg)
    pads = [(predicted(b, raw, cost, epochs, frozenset({shape}) if packer is None
                       else frozenset()), b) for b in combos]
    pad, best = min(pads, key=lambda p: p[0].seconds)
    if packer is None:
        return chosen("pad", why, best, cost, pad)
    pack = predicted(packer, raw, cost, epochs, frozenset({shape}))
    versus = (f"predicted {pack.seconds:.1f} s packed ({pack.steps // epochs} steps an epoch, "
              f"{pack.compiles} compiles, padding efficiency {pack.padding_efficiency:.3f}) "
              f"against {pad.seconds:.1f} s padded ({pad.steps // epochs} steps an epoch, "
              f"{pad.compiles} compiles, {pad.padding_efficiency:.3f})")
    if layout == "auto" and pad.seconds < pack.seconds:
        return chosen("pad", versus, best, cost, pad, pack)
    return chosen("pack", versus if layout == "auto" else "layout='pack' was asked for",
                  packer, cost, pad, pack)


def several_policies(spec: Any, train: Examples, tops: np.ndarray, min_length: int) -> list:
    """Explicit buckets for several lengths: an int K (``Optimal.fit`` with K buckets for each
    length) or a mapping name -> policy, list of sizes or K; each floored at ``min_length``
    and covering the longest example (validation included)."""
    names = train.form.lengths
    if is_int(spec):
        spec = {n: spec for n in names}
    if not isinstance(spec, dict) or set(spec) != set(names):
        raise OptionError(f"fit: buckets: expected 'auto', an int K or a dict naming each of "
                          f"the examples' lengths ({', '.join(map(repr, names))}) with its "
                          f"buckets, received {spec!r}")
    out = []
    for v, name in enumerate(names):
        try:
            policy = (_buckets.Optimal.fit(train.sizes[:, v], max_buckets=check_int(
                spec[name], f"fit: buckets[{name!r}]", min=1)) if is_int(spec[name])
                else _buckets.as_policy(spec[name]))
        except (TypeError, ValueError) as e:
            raise OptionError(f"fit: buckets[{name!r}]: {e}") from e
        sizes = sorted({max(int(s), min_length) for s in policy.sizes})
        if sizes[-1] < tops[v]:
            raise OptionError(f"fit: buckets[{name!r}]: expected a largest bucket >= "
                              f"{int(tops[v])} (the longest {name} of the examples), received "
                              f"{policy!r}")
        out.append(_buckets.Fixed(sizes))
    return out


def measure_several(step: Bucketed, arg: Any, shape: dict, *, extra: Bucketed | None,
                     extra_arg: Any, form: Any) -> _buckets.CostModel:
    """`measure_cost` of ``step`` at ``shape`` (``{"B": rows, name: size}``) on a batch of
    padding, every row one example of every length's full size."""
    sizes = {n: v for n, v in shape.items() if n != "B"}
    lengths = {n: np.full(shape["B"], v, np.int32) for n, v in sizes.items()}
    return measure_cost(step, arg, form.zeros(shape["B"], sizes), lengths, grid=shape,
                        extra_compiles=extra, extra_arg=extra_arg)
