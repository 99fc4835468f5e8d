"""Layouts: where a call's sequences sit in a bucket, and how its outputs come back.

A layout places one call into a bucket (`place`: the bucket to compile at and the program's
inputs) and takes the program's outputs back to what the exact-size call returns (`unplace`).
The executor runs every call the same way through them (`Bucketed._run`); a layout also names
the program it runs (`Program` of a `Segment`) and how that program is compiled at a bucket.

* ``PAD``: one sequence per row. Every input is padded up to the bucket of each length (on
  the host); outputs are cut to their symbolic shapes at the real sizes, and an axis ragged
  along rows has each row's tail reset to the pad. Invariant: row ``b`` holds sequence ``b``
  at columns ``[0, lengths[b])``; the cells beyond exist for no result.
* ``PACK``: several sequences per physical row of a row-length bucket, laid first-fit, with two
  more program inputs per cell: ``pos`` (the cell's position in its sequence, -1 where no
  sequence is) and ``seglen`` (its sequence's length), and a third where the program reads it
  (`Program.reads_sequence`: a random draw along the rows), ``sequence`` (its sequence's index
  in the call, -1 where none is). Invariant: a sequence's cells are
  consecutive columns of one row, from position 0, then the program's room
  (`Program.room`: ``pos`` n, n + 1, ..., the last sequence's past the row's T columns, so
  the layout inputs are ``(rows, T + room)``); per-sequence inputs (lengths, labels) are
  held at every cell of their sequence and read back at its first. Split over devices (a
  sharded ``lengths_of`` argument), the rows are a multiple of the devices and every per-cell
  input is split with its rows: each device holds whole rows, so each sequence lies on one.
  Several ragged variables over the same rows (an encoder-decoder's ``S`` and ``T``): each
  has its own grid and layout inputs (in the variables' sorted order), and an example's
  sequences share one row index in every grid (`buckets.joint_first_fit`).

Both move data on the host, like padding always has: a device gather would compile one small
program per call shape.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import export

import buckets as _buckets

from . import _bind
from ._errors import LengthOverflowError, OptionError, check_int
from ._jax_internals import dim_vars, evaluate_dim
from ._plan import Plan, Segment
from ._spec import Spec
from ._trace import array_outputs, evaluate_shape


class Placed:
    """One call placed into a bucket by a layout: what runs and how its outputs come back."""

    layout: "Layout"
    bucket: dict[str, int]        # the sizes the program is compiled at
    sizes: dict[str, int]         # the call's real sizes (the longest sequence's for packing)
    real: int                     # elements of the length-carrying inputs that are real
    padded: int                   # and all of them, padding included (the stats' efficiency)

    def inputs(self, segment: Segment, handed: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def unplace(self, segment: Segment, out_tree, outputs: Sequence[Any], out_specs: Any):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout's name and how its program of a segment is compiled at a bucket; what differs
    between layouts is here, asked by the executor (`Bucketed`), which never tests a name."""

    name: str
    # Whether a plan holds this layout's own program only when made for it (`plan_function`'s
    # ``pack``): the packed rewrite.
    own_program = False

    def unable(self, plan: Plan) -> str | None:
        """Why this layout cannot run ``plan`` (naming the user's line), None when it can."""
        return None

    def runs(self, plan: Plan) -> bool:
        return self.unable(plan) is None

    def fallback_message(self, name: str, reason: str) -> str:
        """The warning when a function pinned to this layout runs ``reason``'s plan padded."""
        raise NotImplementedError

    def describe(self, bucket: Mapping[str, int]) -> str:
        """``bucket`` as a message names it (``CompileError``)."""
        raise NotImplementedError

    def exported(self, plan: Plan) -> Any:
        """The `jax.export.Exported` this layout runs for ``plan`` (None where there is none:
        reshaping is impossible)."""
        raise NotImplementedError

    def place(self, plan: Plan, call: _bind.BoundCall, sizer, least: Mapping[str, int]
              ) -> "Placed":
        """``call`` placed into a bucket (``sizer``, the `Bucketed`, knows the buckets; a least
        bucket, `Bucketed.call_at_least`'s)."""
        raise NotImplementedError

    def warmup_buckets(self, plan: Plan, sizes: Sequence[Mapping[str, int]] | None, sizer,
                       names: Sequence[str]) -> list[tuple[Segment, dict[str, int]]]:
        """``(segment, bucket)`` pairs `Bucketed.warmup` compiles for ``sizes`` (None: every
        bucket of the input variables ``names``)."""
        raise NotImplementedError

    def stats_key(self, segment: Segment, bucket: Mapping[str, int]) -> tuple:
        raise NotImplementedError

    def program(self, plan: Plan, segment: Segment, bucket: Mapping[str, int], counter
                ) -> tuple[Callable, list[jax.ShapeDtypeStruct], int, list]:
        """``(program, avals, n_convention, out_cell)``: the flat program to compile at
        ``bucket``, its input avals (the first ``n_convention`` are the segment's convention
        inputs, which take the call's shardings) and a cell holding ``(out_tree, out_paths)``
        once traced."""
        raise NotImplementedError

    def with_shardings(self, segment: Segment, avals: Sequence[jax.ShapeDtypeStruct],
                       in_shardings: Sequence[Any] | None) -> list[jax.ShapeDtypeStruct]:
        """The layout's own program inputs (after the convention's) with their shardings:
        the pad layout has none."""
        return list(avals)


# --------------------------------------------------------------------------------------------
# pad


class _Pad(Layout):
    def stats_key(self, segment, bucket):
        return tuple((v.name, bucket[v.name]) for v in segment.live_variables)

    def describe(self, bucket):
        return f"bucket {dict(bucket)}"

    def exported(self, plan):
        return plan.exported

    def program(self, plan, segment, bucket, counter):
        avals = segment.bucket_avals(bucket)
        program, cell = plan.program_at(segment, bucket, counter)
        return program, avals, len(avals), cell

    def place(self, plan, call, sizer, least):
        """``call`` padded up to its bucket, no smaller than ``least`` (before compiling:
        padding may refuse)."""
        # Without the rewrite, code that masks itself by the lengths cannot tell a filler row
        # (length 0) from an example: a mean over the rows would count it. So the rows a
        # `lengths_of` input indexes run at their own number, never padded (one compile per
        # number of rows; a hand-masked per-example mean over 3 rows came back as 3/4 of
        # itself at a bucket of 4).
        exact = () if sizer.masking else call.signature.rows_variables
        bucket = {n: s if n in exact else max(sizer.bucket_for(n, s, plan), least.get(n, 0))
                  for n, s in call.sizes.items()}
        poly, real, padded = _bind.pad_inputs(call, bucket)
        return _Padded(self, call, dict(bucket), dict(call.sizes), real, padded, poly)

    def warmup_buckets(self, plan, sizes, sizer, names):
        if sizes is None:
            combos = [dict(zip(names, c)) for c in itertools.product(
                *(sizer.bucket_sizes(n, plan) for n in names))]
        else:
            combos = [{n: sizer.bucket_for(n, int(s), plan) for n, s in d.items()}
                      for d in sizes]
        return self._segment_buckets(plan, combos, sizer)

    @staticmethod
    def _segment_buckets(plan: Plan, combos: Sequence[Mapping[str, int]], sizer):
        """(segment, bucket) pairs to compile: each segment at every given input bucket combined
        with every bucket of its data-dependent variables (or the ones named in ``combos``)."""
        if plan.mode == "single":
            return [(plan.segments[0], combo) for combo in combos]
        jobs, seen = [], set()
        for seg in plan.segments:
            live = [v.name for v in seg.live_variables]
            for combo in combos:
                fixed = {n: combo[n] for n in live if n in combo}
                free = [n for n in live if n not in combo]
                for values in itertools.product(*(sizer.bucket_sizes(n, plan) for n in free)):
                    sizes = {**fixed, **dict(zip(free, values))}
                    key = (id(seg), tuple(sorted(sizes.items())))
                    if key not in seen:
                        seen.add(key)
                        jobs.append((seg, sizes))
        return jobs


PAD = _Pad("pad")


class _Padded(Placed):
    def __init__(self, layout, call, bucket, sizes, real, padded, poly):
        self.layout, self.call, self.bucket, self.sizes = layout, call, bucket, sizes
        self.real, self.padded, self.poly = real, padded, poly
        self.flat: list[Any] = []

    def inputs(self, segment, handed):
        self.flat = segment.convention.assemble(arrays=self.call.arrays, poly=self.poly,
                                                handed=handed, sizes=self.sizes)
        return segment.feed(self.flat, self.bucket)

    def unplace(self, segment, out_tree, outputs, out_specs):
        """The outputs as the exact-size call returns them: each leaf cut to its symbolic shape
        evaluated at the real sizes (``T - 1`` at T=5 is 4), or by ``out_specs`` when given.
        A reshaping-impossible plan has no symbolic shapes: without ``out_specs`` its outputs
        keep the bucket's size (its verdict has said so). An axis ragged along rows comes back
        at the longest row's length, each row's tail set to the pad (the out Spec's, else 0).
        Counts of in-program data-dependent sizes (``partition=False``) come last."""
        n_user = len(outputs) - len(segment.count_names)
        for name, count in zip(segment.count_names, outputs[n_user:]):
            self.sizes[name] = int(count)
        leaves, sizes = list(outputs[:n_user]), self.sizes
        # Global arrays across processes cannot be read on one: their outputs' ragged tails
        # stay as computed (polyexec.training's steps return losses, which have none).
        ragged = {name: (np.asarray(self.flat[at])[:sizes[rows]], rows)
                  for name, (at, rows) in segment.convention.rows_at.items()
                  if _bind._readable(self.flat[at])}
        specs = [None] * len(leaves)
        if out_specs is not None:
            specs = _bind.spec_per_leaf(out_specs, jax.tree_util.tree_unflatten(
                array_outputs(out_tree), list(range(len(leaves)))), "out_specs")
            leaves = [leaf if spec is _bind.FIXED else _bind.unpad(leaf, spec, sizes)
                      for leaf, spec in zip(leaves, specs)]
        elif segment.exported is not None:
            env = {n: int(s) for n, s in sizes.items()}
            # Sliced on the host, like inputs are padded there: slicing a device array would
            # compile one small program per distinct real size.
            real = [tuple(_real_size(d, env, ragged) for d in aval.shape)
                    for aval in segment.exported.out_avals]
            leaves = [leaf if shape == tuple(leaf.shape) else
                      np.asarray(leaf)[tuple(slice(0, n) for n in shape)]
                      for leaf, shape in zip(leaves, real)]
        if ragged and segment.exported is not None:
            leaves = [clear_ragged_tails(leaf, aval.shape, sizes, ragged,
                                          getattr(spec, "pad", 0) or 0)
                      for leaf, aval, spec in zip(leaves, segment.exported.out_avals, specs)]
        return jax.tree_util.tree_unflatten(out_tree, leaves)


def _real_size(d, env: Mapping[str, int], ragged: Mapping[str, tuple[np.ndarray, str]]) -> int:
    """An output dimension at the real sizes: a count over rows of a length ragged along them
    (``B*T``, a reshape merging the rows) is the sum of the rows' own counts."""
    if not export.is_symbolic_dim(d):
        return int(d)
    names = dim_vars(d)
    for name, (lengths, rows) in ragged.items():
        if name in names and rows in names:
            per_row = np.maximum(np.asarray(evaluate_dim(
                d // export.symbolic_shape(rows, scope=d.scope)[0], {**env, name: lengths})), 0)
            return int(np.sum(per_row))
    # A ragged length alone: the longest real row's (the input may be wider than that).
    longest = {name: int(lengths.max(initial=0)) for name, (lengths, _) in ragged.items()
               if name in names}
    return max(int(evaluate_dim(d, {**env, **longest})), 0)


def clear_ragged_tails(leaf, shape, sizes: Mapping[str, int],
                        ragged: Mapping[str, tuple[np.ndarray, str]], pad) -> Any:
    """``leaf`` with each row's positions beyond its own length (along every axis ragged along
    a rows axis the leaf has) set to ``pad``: they do not exist, whatever the program left
    there. On the host, like the slicing before it."""
    out = None
    for axis, d in enumerate(shape):
        if not export.is_symbolic_dim(d):
            continue
        names = dim_vars(d)
        for name, (lengths, rows) in ragged.items():
            row_axes = [k for k, r in enumerate(shape) if export.is_symbolic_dim(r) and str(r) == rows]
            if name not in names or rows in names or len(row_axes) != 1:
                continue
            env = {**sizes, name: lengths}
            per_row = np.maximum(np.asarray(evaluate_dim(d, env)), 0)        # (rows,)
            if out is None:
                out = np.array(leaf)
            index = [1] * out.ndim
            index[axis] = out.shape[axis]
            beyond = np.arange(out.shape[axis]).reshape(index) >= np.expand_dims(
                per_row, [k for k in range(out.ndim) if k != row_axes[0]])
            out = np.where(beyond, np.asarray(pad, out.dtype), out)
    return leaf if out is None else out


# --------------------------------------------------------------------------------------------
# pack


class _Pack(Layout):
    own_program = True

    def unable(self, plan):
        return plan.packing_reason

    def fallback_message(self, name, reason):
        return (f"{name} cannot run packed rows, so it runs one sequence per padded row "
                f"(layout='pad', the same results): {reason}")

    def describe(self, bucket):
        return f"{self.name}ed rows {dict(bucket)}"

    def exported(self, plan):
        return plan.segments[0].program(self.name).exported

    def stats_key(self, segment, bucket):
        """``(("rows(B)", R), ("row_length(T)", L))`` (a row length per packed variable)."""
        names, rows_var = packed_variables(segment)
        return ((f"rows({rows_var})", bucket[rows_var]),
                *((f"row_length({var})", bucket[var]) for var in names))

    def program(self, plan, segment, bucket, counter):
        packed = segment.program(self.name).exported
        avals = [jax.ShapeDtypeStruct(evaluate_shape(a.shape, bucket), a.dtype)
                 for a in packed.in_avals]
        # The convention's inputs come first; the layout arrays (pos, seglen[, sequence])
        # follow.
        return packed.call, avals, len(segment.convention.slots), [segment.out_tree,
                                                                    segment.out_paths]

    def with_shardings(self, segment, avals, in_shardings):
        """``pos``, ``seglen`` (and ``sequence``) are ``(rows, row length)`` grids: split over
        the devices like the rows (the sharding of the argument holding the rows' lengths,
        whose one axis is the rows), so a device's cells and their positions are together."""
        rows = _rows_sharding(segment, in_shardings)
        if rows is None:
            return list(avals)
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows) for a in avals]

    def place(self, plan, call, sizer, least):
        """Where ``call``'s sequences go: rows of the smallest row length (a bucket of T) that
        holds the longest, as many as first-fit needs bucketed by B's buckets or the run's
        ``pack_rows`` (``sizer``, the `Bucketed`, knows both), the sequences spread over all
        of them (`buckets.balanced_fit`): the packed program's scans stop at the last real
        column. The grid's arrays are built only when the call runs packed (`inputs`):
        ``layout="auto"`` prices a call by its cells alone and may run it padded. A least
        bucket (`Bucketed.call_at_least`) changes nothing: a packed call's rows are its own."""
        segment = plan.segments[0]
        names, rows_var = packed_variables(segment)
        count = segment.convention.count("array")
        lengths = {var: np.asarray(call.poly[at - count]).astype(np.int64).reshape(-1)
                   for var, (at, _) in segment.convention.rows_at.items()}
        packings, n_rows = self.packing(plan, lengths, sizer)
        program = segment.program(self.name)
        grids = {var: _Grid(lengths[var], packings[var], n_rows, var, rows_var, program)
                 for var in names}
        return _Packed(self, call, grids, sizer.bucket_for, plan)

    def packing(self, plan: Plan, lengths: Any, sizer) -> tuple[dict[str, Any], int]:
        """``({variable: buckets.Packing}, rows)``: where sequences of ``lengths`` (an array,
        or one per packed variable) go in the grids `place` builds, from their lengths alone
        (`polyexec.training` reads which rows each process holds from it before loading the
        examples). Each sequence takes the cells the program says (`Program.cells`: the room
        after it, a cell for an empty one) in rows of the row length (its variable's bucket)
        and the room: the last sequence of a row may keep its room past the row's T columns,
        so a Packing's ``row_length`` is ``T + room``, the width of the layout inputs.

        Several packed variables (an encoder-decoder's S and T): an example's sequences go
        into the same row of every variable's grid, first-fit by all of them at once
        (`buckets.joint_first_fit`), so a cross term (``(B, T, S)`` scores) pairs only the cells of
        one example."""
        segment = plan.segments[0]
        names, rows_var = packed_variables(segment)
        if not isinstance(lengths, Mapping):
            lengths = {names[0]: lengths}
        program = segment.program(self.name)
        cells = {var: program.cells(np.asarray(lengths[var]), var) for var in names}
        row_lengths = {var: sizer.bucket_for(var, max(int(np.max(lengths[var], initial=0)), 1),
                                             plan) for var in names}
        widths = {var: row_lengths[var] + program.room_of(var) for var in names}
        if len(names) == 1:
            (var,) = names
            first = _buckets.first_fit(cells[var], widths[var])
            n_rows = self.packed_rows(plan, rows_var, row_lengths[var], first.rows, sizer)
            return {var: _buckets.balanced_fit(cells[var], widths[var], n_rows,
                                               first=first)}, n_rows
        row, starts, needed = _buckets.joint_first_fit(cells, widths)
        n_rows = self.packed_rows(plan, rows_var, row_lengths[names[0]], needed, sizer)
        return {var: _buckets.Packing(row, starts[var], n_rows, widths[var])
                for var in names}, n_rows

    def packing_of(self, plan: Plan, lengths: Any, sizer, running: "Layout | None"
                   ) -> tuple[np.ndarray, int]:
        """`Bucketed.packing_of` of ``sizer``, whose calls of ``plan`` run in ``running``
        (None: chosen per call): ``(row of each sequence, rows)``."""
        if running is not self:
            reason = self.unable(plan)
            raise OptionError(f"{sizer.name}.packing_of: expected a function that runs packed "
                              f"rows (layout='pack' and a plan that can pack), received "
                              f"layout={sizer.layout!r}"
                              + ("" if reason is None else f" ({reason})"))
        if not isinstance(lengths, Mapping):
            lengths = np.asarray(lengths, np.int64).reshape(-1)
        packings, rows = self.packing(plan, lengths, sizer)
        return np.asarray(next(iter(packings.values())).row), rows

    def packed_rows(self, plan: Plan, rows_var: str, row_length: int, needed: int, sizer
                    ) -> int:
        """The rows a packed grid of ``row_length`` runs at when ``needed`` are filled:
        ``sizer.pack_rows[row_length]`` when it holds them, else B's bucket -- rounded up to a
        multiple of the devices the rows are split over (`row_shards`): each device then
        holds whole rows, so each sequence lies on one device, and the added rows are empty
        (no cell of theirs is real)."""
        rows = sizer.pack_rows.get(row_length, 0)
        if rows < max(needed, 1):
            rows = sizer.bucket_for(rows_var, max(needed, 1), plan)
        shards = row_shards(plan.segments[0], sizer.in_shardings)
        return -(-rows // shards) * shards

    def warmup_buckets(self, plan, sizes, sizer, names):
        """Packed grids: ``{B: rows, T: row length}`` sizes at the rows a call of that many
        rows would run (``pack_rows``, else B's bucket); by default every ``pack_rows`` entry,
        or else every B x T bucket."""
        segment = plan.segments[0]
        names, rows_var = packed_variables(segment)
        var, others = names[0], names[1:]
        if sizes is None:
            grids = ([{rows_var: r, var: n} for n, r in sorted(sizer.pack_rows.items())]
                     or [{rows_var: r, var: n} for r in sizer.bucket_sizes(rows_var, plan)
                         for n in sizer.bucket_sizes(var, plan)])
            for other in others:      # every row length of each other packed variable
                grids = [{**g, other: n} for g in grids
                         for n in sizer.bucket_sizes(other, plan)]
        else:
            grids = []
            for d in sizes:
                n = sizer.bucket_for(var, int(d[var]), plan)
                grids.append({var: n, rows_var: self.packed_rows(plan, rows_var, n,
                                                                 int(d[rows_var]), sizer),
                              **{o: sizer.bucket_for(o, int(d[o]), plan) for o in others}})
        return [(segment, grid) for grid in grids]

    @staticmethod
    def check_rows(pack_rows: Mapping[int, int] | None, where: str) -> dict[int, int]:
        """The ``pack_rows`` option checked: row length -> rows, both positive ints."""
        if pack_rows is not None and not isinstance(pack_rows, Mapping):
            raise OptionError(f"{where}: pack_rows: expected a mapping row length -> rows, "
                              f"received {pack_rows!r}")
        return {check_int(k, f"{where}: pack_rows key (a row length)", min=1):
                check_int(v, f"{where}: pack_rows[{k}]", min=1)
                for k, v in (pack_rows or {}).items()}


PACK = _Pack("pack")


def packed_variables(segment: Segment) -> tuple[list[str], str]:
    """The packed variables of ``segment`` in the order of their layout inputs, and the rows
    variable they are ragged along (the packed rewrite refuses several)."""
    rows_at = segment.convention.rows_at
    return sorted(rows_at), next(iter(rows_at.values()))[1]


def _rows_sharding(segment: Segment, in_shardings: Sequence[Any] | None) -> Any:
    """The sharding of the argument that holds the packed rows' lengths (a ``lengths_of``
    input of dims ``"B"``), or None (unsharded)."""
    if in_shardings is None or not segment.convention.rows_at:
        return None
    names, _ = packed_variables(segment)
    at, _ = segment.convention.rows_at[names[0]]
    arg = segment.convention.slots[at].arg
    return in_shardings[arg] if arg is not None and arg < len(in_shardings) else None


def row_shards(segment: Segment, in_shardings: Sequence[Any] | None) -> int:
    """Into how many parts the rows of a packed grid are split (the devices along the rows
    axis of its sharding; 1 unsharded or replicated): its rows must be a multiple of it."""
    sharding = _rows_sharding(segment, in_shardings)
    if sharding is None:
        return 1
    devices = len(sharding.device_set)
    return devices // sharding.shard_shape((devices,))[0]


class _Packed(Placed):
    """One call in packed rows: a `_Grid` per packed variable, the same rows in each."""

    def __init__(self, layout, call, grids: Mapping[str, "_Grid"], bucket_for, plan):
        self.layout, self.call, self.grids = layout, call, dict(grids)
        self._bucket_for, self._plan = bucket_for, plan
        self.first = self.grids[min(self.grids)]   # per-sequence outputs come back in it
        rows_var, n = self.first.rows_var, len(self.first.lengths)
        self.bucket = {rows_var: self.first.rows,
                       **{var: g.row_length for var, g in self.grids.items()}}
        self.sizes = {**call.sizes, rows_var: n,
                      **{var: g.longest for var, g in self.grids.items()}}
        self.real = self.padded = 0

    @property
    def cells(self) -> int:
        return sum(g.rows * g.row_length for g in self.grids.values())

    def padded_cells(self, plan: Plan, sizer) -> int | float:
        """The cells of the same call in the pad layout: its (B, T) bucket, per packed
        variable (infinite when B has no bucket that holds the sequences)."""
        first = self.first
        try:
            rows = sizer.bucket_for(first.rows_var, max(len(first.lengths), 1), plan)
        except LengthOverflowError:
            return float("inf")
        return sum(rows * sizer.bucket_for(var, max(g.longest, 1), plan)
                   for var, g in self.grids.items())

    def _grid_of(self, spec: Spec) -> "_Grid":
        """The grid an input of ``spec`` goes to: its packed variable's, that of the lengths
        it gives, else the first."""
        named = [var for var in self.grids if var in spec.dims]
        if len(named) > 1:
            raise ValueError(f"an input of dims {spec.dims!r} has several packed lengths "
                             f"({', '.join(named)}): packed rows hold each in its own grid; "
                             f"run it with layout='pad'")
        var = named[0] if named else spec.lengths_of if spec.lengths_of in self.grids else None
        return self.grids[var] if var is not None else self.first

    def inputs(self, segment, handed):
        poly = []
        row_lengths = {var: g.row_length for var, g in self.grids.items()}
        for arr, (spec, dtype) in zip(self.call.poly, self.call.signature.poly):
            grid = self._grid_of(spec)
            poly.append(grid.pack(np.asarray(arr), spec, dtype, self._bucket_for, self._plan,
                                  row_lengths))
            if grid.var in spec.dims and grid.rows_var in spec.dims:
                rest = int(np.prod(poly[-1].shape)) // (grid.rows * grid.row_length)
                self.real += int(grid.lengths.sum()) * rest
                self.padded += grid.rows * grid.row_length * rest
        flat = segment.convention.assemble(arrays=self.call.arrays, poly=poly, sizes=self.sizes)
        program = segment.program(self.layout.name)
        layout = []
        for var in sorted(self.grids):
            grid = self.grids[var]
            layout += [grid.pos, grid.seglen]
            if program.reads_sequence:
                layout.append(grid.sequence)
        return list(flat) + layout

    def unplace(self, segment, out_tree, outputs, out_specs):
        """Per-sequence outputs cut back out of their rows (`_Grid.unpack`), each from its
        variable's grid."""
        leaves, packed = [], set(self.grids)
        for leaf, aval in zip(outputs, segment.jaxpr.out_avals):
            names = [dim_vars(d) for d in aval.shape]
            axes = [a for a, n in enumerate(names)
                    if n & packed and self.first.rows_var not in n]
            named = set().union(*names) & packed
            if len(axes) == 2:
                leaves.append(self._unpack_pairs(leaf, aval.shape, axes))
            else:
                grid = self.grids[named.pop()] if len(named) == 1 else self.first
                leaves.append(grid.unpack(leaf, aval.shape, self.sizes))
        return jax.tree_util.tree_unflatten(out_tree, leaves)

    def _unpack_pairs(self, leaf, shape, axes):
        """An output pairing two packed lengths (attention weights, ``(B, T, S)`` or
        ``(B, T, T)``) as the pad layout returns it: each example's own ``e(n) x e'(m)``
        block, cut from its row at its start column in each length's grid, zeros after."""
        (b,) = [a for a, d in enumerate(shape) if dim_vars(d) == {self.first.rows_var}]
        grids = [self.grids[next(iter(dim_vars(shape[a]) & set(self.grids)))] for a in axes]
        per = [np.broadcast_to(np.maximum(np.asarray(evaluate_dim(
                   shape[a], {**self.sizes, g.var: g.lengths})), 0), g.lengths.shape).astype(
                   np.int64) for a, g in zip(axes, grids)]
        x = np.moveaxis(np.asarray(leaf), (b, *axes), (0, 1, 2))
        out = np.zeros((len(self.first.lengths), *(int(n.max(initial=0)) for n in per),
                        *x.shape[3:]), x.dtype)
        count = per[0] * per[1]
        seq, k = np.repeat(np.arange(len(count)), count), _cells_of(count)[1]
        i, j = k // np.maximum(per[1][seq], 1), k % np.maximum(per[1][seq], 1)
        out[seq, i, j] = x[self.first.packing.row[seq], grids[0].packing.start[seq] + i,
                           grids[1].packing.start[seq] + j]
        return np.moveaxis(out, (0, 1, 2), (b, *axes))


class _Grid:
    """Where each sequence of one packed call sits, and the moves in and out of that grid."""

    def __init__(self, lengths: np.ndarray, packing, rows: int, var: str, rows_var: str,
                 program):
        self.lengths, self.packing, self.rows = lengths, packing, rows
        self.var, self.rows_var = var, rows_var
        # `packing` placed each sequence as `Program.cells` cells: its own, the room after it
        # (``pos`` n, n + 1, ...: an axis of T + c holds positions past n there), and a cell
        # for one of length 0 whose per-sequence values the program holds. The rows are
        # ``row_length`` (T's bucket) columns, the layout inputs ``width`` (and the room).
        self.cells_per_sequence = program.cells(lengths, var)
        self.width = packing.row_length
        self.row_length = packing.row_length - program.room_of(var)

    def _placed(self, counts: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(sequence, position, row, column)`` of the first ``counts[i]`` cells of each
        sequence ``i``, from its start column."""
        seq, offset = _cells_of(counts)
        return seq, offset, self.packing.row[seq], self.packing.start[seq] + offset

    @functools.cached_property
    def real_cells(self) -> tuple[np.ndarray, ...]:
        """`_placed` of each sequence's real cells: where its inputs go."""
        return self._placed(self.lengths)

    @functools.cached_property
    def sequence_cells(self) -> tuple[np.ndarray, ...]:
        """`_placed` of every cell a sequence holds: its real cells, its room, its one cell
        if it is empty and the program holds per-sequence values -- where its per-sequence
        values are."""
        return self._placed(self.cells_per_sequence)

    def _layout_input(self, fill: int, value) -> np.ndarray:
        """A ``(rows, width)`` int32 layout input: ``value(sequence, position)`` at each cell
        of a sequence (`sequence_cells`), ``fill`` elsewhere."""
        out = np.full((self.rows, self.width), fill, np.int32)
        seq, offset, row, column = self.sequence_cells
        out[row, column] = value(seq, offset)
        return out

    @functools.cached_property
    def pos(self) -> np.ndarray:
        """Each cell's position in its sequence (room cells: n, n + 1, ...), -1 where no
        sequence is."""
        return self._layout_input(-1, lambda seq, offset: offset)

    @functools.cached_property
    def sequence(self) -> np.ndarray:
        """Each cell's sequence's index in the call (its row in the pad layout), -1 where no
        sequence is."""
        return self._layout_input(-1, lambda seq, offset: seq)

    @functools.cached_property
    def seglen(self) -> np.ndarray:
        """Each cell's sequence's length, 0 where no sequence is."""
        return self._layout_input(0, lambda seq, offset: self.lengths[seq])

    @property
    def longest(self) -> int:
        return int(self.lengths.max(initial=0))

    def pack(self, arr: np.ndarray, spec: Spec, dtype, bucket_for, plan,
             row_lengths: Mapping[str, int]) -> np.ndarray:
        dims = list(spec.dims)
        if self.rows_var in dims and self.var in dims:
            b, t = dims.index(self.rows_var), dims.index(self.var)
            x = np.moveaxis(arr, (b, t), (0, 1))
            out = np.full((self.rows, self.row_length) + x.shape[2:], spec.pad, dtype)
            seq, offset, row, column = self.real_cells
            out[row, column] = x[seq, offset]
            return np.moveaxis(out, (0, 1), (b, t))
        if self.rows_var in dims:
            # Per sequence (the lengths, labels): at every cell of its sequence, a columns axis
            # after the rows axis.
            b = dims.index(self.rows_var)
            x = np.moveaxis(arr, b, 0)
            out = np.zeros((self.rows, self.width) + x.shape[1:], dtype)
            seq, _, row, column = self.sequence_cells
            out[row, column] = x[seq]
            return np.moveaxis(out, (0, 1), (b, b + 1))
        bucket = {n: bucket_for(n, s, plan) for n, s in zip(dims, arr.shape) if isinstance(n, str)}
        bucket.update(row_lengths)
        return _bind.pad_to(arr.astype(dtype, copy=False),
                            [bucket.get(d, s) if isinstance(d, str) else s
                             for d, s in zip(dims, arr.shape)], spec.pad)

    def unpack(self, leaf, shape, sizes: Mapping[str, int]):
        """An output as the pad layout returns it: a ``(B, T-like)`` pair of axes becomes
        ``(sequences, e(longest))`` with each sequence's own ``e(n)`` positions and zeros
        after; other length axes are cut to their real sizes (on the host). An output with
        no length axis (a loss, a train step's new parameters) stays on the device: reading
        it would wait for the step, and the caller's next batch could not overlap it."""
        names = [dim_vars(d) for d in shape]
        if not any(names):
            return leaf
        leaf = np.asarray(leaf)
        b = [a for a, n in enumerate(names) if n == {self.rows_var}]
        t = [a for a, n in enumerate(names) if self.var in n and self.rows_var not in n]
        if len(b) == 1 and len(t) == 1:
            b, t = b[0], t[0]
            d = shape[t]
            per = np.maximum(np.asarray(evaluate_dim(d, {**sizes, self.var: self.lengths})), 0)
            per = np.broadcast_to(per, self.lengths.shape).astype(np.int64)
            x = np.moveaxis(leaf, (b, t), (0, 1))
            out = np.zeros((len(self.lengths), int(per.max(initial=0))) + x.shape[2:], x.dtype)
            # Each sequence's e(n) positions from its start column: past n (T + 2) they lie
            # in its room.
            seq, offset, row, column = self._placed(per)
            out[seq, offset] = x[row, column]
            return np.moveaxis(out, (0, 1), (b, t))
        if len(b) == 1 and not t:
            # Per sequence: held at every cell of its sequence; read at its first.
            b = b[0]
            x = np.moveaxis(leaf, (b, b + 1), (0, 1))
            return np.moveaxis(x[self.packing.row, self.packing.start], 0, b)
        real = evaluate_shape(shape, sizes)
        return leaf[tuple(slice(0, n) for n in real)] if real != tuple(leaf.shape) else leaf


def _cells_of(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sequence, offset)`` of every cell of sequences laid end to end, ``counts`` cells
    each."""
    seq = np.repeat(np.arange(len(counts)), counts)
    return seq, np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)

