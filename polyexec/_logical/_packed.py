"""Packed rows: the logical program when several sequences share each physical row.

With ``layout="pack"`` the sequences of a call (the rows of its ``(B, T)`` inputs, T ragged
along B) are laid end to end in rows of one row length (`buckets.balanced_fit`), and
the one symbolic program runs with ``B`` bound to the number of packed rows and ``T`` to the
row length. Extra inputs describe the layout, per cell of the ``(B, T)`` grid: ``pos``,
the cell's position inside its sequence (-1 in padding), ``seglen``, its sequence's length,
and, only in a program that reads it (a random draw along the rows), ``sequence``, its
sequence's index in the call's batch (-1 in padding).

The room
--------
A program with a length past ``T`` by a constant (``T + 2``: ``jnp.pad`` along T by one cell
each side; ``T + 1``: a window padded at its end) needs that many cells after each sequence:
its room, ``k`` the largest such constant (`room_of`, found by a walk of the program before
the rewrite; `Logical.room`). The layout leaves ``k`` cells after every sequence, the last
one of a row past the row's ``T`` columns: the layout inputs are ``(B, T + k)``. Room cells
belong to their sequence -- ``pos`` n, n + 1, ..., ``seglen`` n, ``sequence`` its index -- so
the frame of an axis of ``T + c`` includes its first ``c`` room cells and the frame of ``T``
none of them; per-sequence values are held there too. Only ``in_frame`` says which cells
are real: ``pos >= 0`` says a cell belongs to a sequence (its start column, its per-sequence
values), never that it is real.

The frame
---------
A sequence starts at the same column in every value with a ``(B, T-like)`` pair of axes: a
value whose T-like axis has length ``e(T)`` (``T``, ``T - 1``) holds position ``p`` of a
sequence of length ``n`` at column ``start + p`` for ``p < e(n)``; every other cell is "don't
care". Slicing ``x[:, 1:]`` and ``x[:, :-1]`` keeps that by construction (column ``q`` reads
``q + 1``), which is why the frame is the segments' start columns and not their contents. A
length past ``T`` by at most the room (``T + 2``) holds its positions past n in the room; one
that can exceed it (``2*T``) has no room in the frame and is not packable.

Rules
-----
Inside a packed row the pad layout's rules would mix sequences, so this context admits only:

- per-position equations (elementwise, layout, contractions over feature axes, gathers and
  scatters that index feature axes) -- they run unchanged;
- reductions and contractions over *both* the rows and a packed length (a loss summed over
  every token, a weight gradient), with the cells outside the frame masked;
- a scan over a packed length: it walks the columns and restarts each row's carry from its
  initial value at every sequence start; its body sees one cell per row, and a reduction
  over the rows there reads only the rows whose cell is real;
- values pairing two cells of a row (attention's ``(B, H, T, T)`` scores): their frame is
  the pairs of real cells of one sequence. ``q @ k.T`` runs unchanged; a reduction over one of
  the pair's lengths (softmax) or a contraction over it (``w @ v``) reads the frame only;
- a convolution along a packed length with stride 1 (causal, centred, dilated, depthwise):
  each tap reads its own sequence and zeros past its edges; its kernel gradient pairs the
  input and the output gradient within each sequence. A stride would start each sequence's
  outputs at another column, so it is refused;
- reversing a packed length (``jnp.flip``, a bidirectional RNN's backward half): each
  sequence in place; a cumulative op along it (``cumsum``, ``cummax``, ... either way): each
  sequence's running value from its own first cell; a sort along it (``jnp.sort``,
  ``argsort``): each sequence in place; ``top_k`` along it: each sequence's own ``k``
  largest and their positions, held per sequence, and its gradient back at those positions;
- a gather along a packed length with one index per cell, positions inside the cell's own
  sequence (``take_along_axis(x, jnp.argsort(x, axis=1), 1)``, ``x[b, idx]``, a sort's JVP,
  and so the gradients of ``jnp.sort`` and ``jnp.median``): cell ``(r, c)`` reads column
  ``start(r, c) + index(r, c)``, the position clamped into (CLIP) or checked against
  (FILL_OR_DROP) the sequence's own ``[0, n)``; its transpose, a scatter-add, writes there,
  and nothing from a cell outside the frame;
- a window along a packed length with stride 1 (``reduce_window`` sum, max, min): each window
  reads its own sequence and the init value past its edges (a sum window's gradient pads the
  length into the room, and packs; a max window's selects and scatters, and does not);
- concatenating along a packed length (``concatenate([bos, x[:, :-1]], 1)``) and its
  transpose, a split: each sequence's pieces from its own start column at its own offsets,
  a constant-length piece held per sequence;
- broadcasting a per-position value (``pe[:T]``, a causal ``(T, T)`` mask) into the rows,
  ``iota`` along the packed length (each cell's position), and ``pad`` along it (per
  sequence, by constant amounts: positive ones into the room, negative ones -- a pad's
  transpose -- dropping positions); ``x[:, k:k + m]`` and ``x[:, T - 1:T]`` (a constant
  number of positions, as ``jnp.pad``'s edge and reflect modes slice) per sequence, and a
  per-sequence value padded back into a packed length (their gradients); a reduction over
  the rows alone back to a per-position value (that broadcast's gradient): per position,
  over every sequence's cell there; a per-position matrix contracted with packed rows
  (``einsum("ts,bsf->btf", jnp.tri(T), x)``): placed by position, then within each sequence;
- a random draw along the rows and a packed length (dropout): each cell draws by its
  sequence's index in the call's batch and its position, as the pad layout does (`_random`);
  one along the rows alone (a ``(B, F)`` noise) by its sequence's index, per sequence;
- ``jnp.arange(B)``: each cell's sequence's index in the call (not its packed row's), and
  ``h[rows, positions]`` (``h[jnp.arange(B), lengths - 1]``) reads the sequence each row
  names, wherever it is packed;
- ``x.shape`` as a number when it counts over the rows (``nll.size`` is the number of real
  predictions) or is the number of sequences.

A per-sequence value (a scan's final carry that is read, a reduction or a contraction along
T alone, ``x[:, k]``, ``take_along_axis(x, (lengths - 1)[:, None, None], 1)``,
``h[jnp.arange(B), lengths - 1]``,
``x.shape[1]`` as a number, a ``(B,)`` input such as the lengths or the
labels) is held at every cell of its sequence (`_sequences.PerSequence`, whose rules are
there). A per-sequence number meeting positions without the rows axis (``jnp.arange(T) /
T``, the ``T - 1 - iota`` that ``x[:, ::-1]`` indexes with) is held per cell (`PerCell`): it
stays per cell through elementwise maths and reverses, and ``x[:, index]`` with it reads each
sequence's own positions. A value no rule keeps becomes a `NotPacked` placeholder that fails
the plan only if something reads it (a final carry nobody reads costs nothing); everything else
is `Unsupported` with the user's line, and ``layout="auto"`` then runs the pad layout, where
the same program is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._context import equation_line
from .._jax_internals import dim_bounds, dim_vars, evaluate_dim, var_dim
from ._core import (ELEMENTWISE, Ctx, Logical, NoRule, Recorder, RowVarying, Unsupported, bind_eqn,
                    bind_eqn_with, defrule, eval_jaxpr, filled, is_sym, like_aval,
                    lookup_rule, lowest_value, moves_ragged_rows, padded_rule, replay, sub_jaxprs,
                    take_rows)
from ._control import at_step, frozen_scan
from ._families import REDUCERS, SCATTERS
from ._indexing import gather_fill
from ._sequences import (PerSequence, at_column, by_cell, grid_shape, held, spread,
                         to_cells)
from ._sequences import evaluate as _evaluate_per_sequence


@dataclasses.dataclass(frozen=True)
class NotPacked:
    """A value that differs per sequence and has no cell of its own in a packed row; reading it
    makes the program unpackable (the reason names where it was made)."""

    why: str


@dataclasses.dataclass(frozen=True)
class PerCell:
    """A value without the rows axis that differs per sequence all the same: a per-sequence
    number meeting positions (``jnp.arange(T) / T``; ``T - 1 - iota``, which ``x[:, ::-1]``
    indexes with). ``value`` is the logical value with the rows axis in front, so cell
    ``(r, c)`` of a packed length holds the entry of the sequence there, at its position."""

    value: Any


class _PackedCtx(Ctx):
    """The evaluation context of a packed program: ``var`` (T) is packed along ``rows`` (B)."""

    def __init__(self, sizes, recorder, parent=None, eqn=None, alive=None, *, var: str,
                 rows: str, pos, seglen, sequence, room: int = 0):
        super().__init__(sizes, recorder, parent, eqn, {var: (None, rows)}, alive)
        self.var, self.rows_name, self.pos, self.seglen = var, rows, pos, seglen
        self.sequence = sequence
        # The cells after each sequence that belong to it (``pos`` n, n + 1, ...): an axis of
        # ``T + c`` (c <= room) holds the sequence's positions past n there.
        self.room = room

    def child(self, eqn, *, alive=None) -> "_PackedCtx":
        if alive is not None and self.alive is not None:
            alive = lax.bitwise_and(alive, self.alive)
        return _PackedCtx(self.sizes, self.recorder, self, eqn,
                          self.alive if alive is None else alive, var=self.var,
                          rows=self.rows_name, pos=self.pos, seglen=self.seglen,
                          sequence=self.sequence, room=self.room)

    # -- axes -----------------------------------------------------------------------------------

    def row_axes(self, shape, rows: str | None = None) -> list[int]:
        return [i for i, s in enumerate(shape) if is_sym(s) and str(s) == self.rows_name]

    def packed_axes(self, shape) -> list[int]:
        """Axes whose length is an expression of the packed variable (T, T - 1), not a count
        over the rows."""
        return [i for i, s in enumerate(shape)
                if self.var in dim_vars(s) and self.rows_name not in dim_vars(s)]

    def rows_of(self, d) -> str | None:
        return self.rows_name if self.var in dim_vars(d) else None

    # -- lengths --------------------------------------------------------------------------------

    def length(self, d, shape=None, shared=None):
        """A length in the packed frame. The rows axis: every physical row (their cells say
        which are real). A packed length of a value with a rows axis: per cell, the column
        where its sequence's part of the axis ends (``iota < length`` is the frame). A count
        over the rows (``B*T``): the sum over the sequences. A value without rows: real up to
        the longest sequence, except one made from lengths alone (refused, as in
        `Ctx.length`)."""
        if not is_sym(d):
            return int(d)
        names = dim_vars(d)
        if self.var not in names:
            if self.rows_name in names:
                if str(d) != self.rows_name:
                    raise NoRule(f"the length {d} counts packed rows")
                return self.physical(d)
            return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))
        if self.rows_name in names:
            return self._summed(d, self.rows_name)
        if shape is not None:
            rows, packed = self.row_axes(shape), self.packed_axes(shape)
            if rows:
                if len(rows) != 1 or len(packed) != 1:
                    raise NoRule(f"a value of shape {tuple(shape)} mixes sequences of a packed "
                                  f"row (it needs exactly one rows axis and one packed length)")
                return _along(self.ends(shape[packed[0]]), len(shape), rows[0], packed[0])
            if shared is False or (shared is None and tuple(shape) in self.from_lengths_shapes):
                raise NoRule(f"a value of shape {tuple(shape)} reads its length {d}, which "
                              f"differs per sequence of a packed row, and has no rows axis to "
                              f"hold each sequence's result")
        elif self.current is not None and self._has_rows(self.current, self.rows_name):
            raise NoRule(f"{self.current.primitive.name} reads the length {d}, which differs "
                          f"per sequence of a packed row")
        # A value without rows: per position, real up to the longest sequence.
        return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))

    def _has_rows(self, eqn, rows: str) -> bool:
        return any(self.row_axes(getattr(v.aval, "shape", ()))
                   for v in (*eqn.invars, *eqn.outvars))

    def cells(self, d):
        """``(pos, seglen)`` of the first ``d`` columns (an axis of packed length ``d``)."""
        return (lax.slice_in_dim(self.pos, 0, d, axis=1),
                lax.slice_in_dim(self.seglen, 0, d, axis=1))

    def sequence_index(self, d):
        """``(rows, d)`` int32 of the first ``d`` columns: each cell's sequence's index in the
        call's batch (the row it has in the pad layout), -1 where no sequence is. The program
        then takes that layout input (`Logical.reads_sequence`)."""
        self.recorder.reads_sequence = True
        return lax.slice_in_dim(self.sequence, 0, d, axis=1)

    def in_frame(self, d):
        """``(rows, d)`` bool: the cells inside the frame of an axis of packed length ``d``."""
        pos, seglen = self.cells(d)
        return (pos >= 0) & (pos < self._at(d, seglen))

    def starts(self, d, fill: int | None = None):
        """``(rows, d)`` int32: per cell in the frame of an axis of packed length ``d``, the
        column where its sequence starts (the same in every axis: the frame); ``fill``
        elsewhere (None: the cell's own column)."""
        pos, _ = self.cells(d)
        column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
        return jnp.where(self.in_frame(d), column - pos, column if fill is None else fill)

    def sequence_starts(self):
        """``(rows, columns)`` int32: per cell of a sequence (its real cells, or the one cell a
        sequence of length 0 holds its per-sequence values at) the column where the sequence
        starts; elsewhere the cell's own column."""
        column = lax.broadcasted_iota(np.int32, jnp.shape(self.pos), 1)
        return jnp.where(self.pos >= 0, column - self.pos, column)

    def frame(self, shape):
        """bool ``shape``: the cells of a value with one rows axis and one or two packed
        lengths that hold a real position (one axis), or a pair of real positions of the same
        sequence (two axes: attention's scores)."""
        (r,), packed = self.row_axes(shape), self.packed_axes(shape)
        if len(packed) == 1:
            return spread(self.in_frame(shape[packed[0]]), shape, (r, packed[0]))
        p, q = packed
        same = (self.starts(shape[p], -1)[:, :, None]
                == self.starts(shape[q], -2)[:, None, :])          # (rows, p, q)
        return spread(same, shape, (r, p, q))

    def frame_only(self, x, fill):
        """``x`` with ``fill`` outside its frame (see `frame`)."""
        return lax.select(self.frame(x.shape), x, filled(x.shape, fill, x.dtype))

    def ends(self, d):
        """``(rows, d)`` int32: per cell, the column where its sequence's part ends (-1 in
        padding), so ``column < ends`` is the frame."""
        pos, seglen = self.cells(d)
        column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
        return jnp.where(pos >= 0, column - pos + self._at(d, seglen), -1).astype(np.int32)

    def _at(self, d, seglen, *, as_value: bool = False):
        """``d`` at each cell's sequence length (``seglen``): never below 0 as the length of
        an axis, as it is as a value (see `Ctx.per_row`)."""
        value = evaluate_dim(d, {**self.sizes, self.var: seglen})
        return (value if as_value else jnp.maximum(value, 0)).astype(np.int32)

    def _summed(self, d, rows: str):
        b = var_dim(rows, d.scope)
        q = d // b
        if q * b != d or rows in dim_vars(q):
            raise NoRule(f"the length {d} is not a count over the sequences")
        starts = self.pos == 0
        per = (self._at(q, self.seglen) if is_sym(q) else jnp.full(jnp.shape(self.pos), int(q)))
        return jnp.sum(jnp.where(starts, per, 0)).astype(np.int32)

    def row_mask(self, rows: str):
        return self.alive

    def all_real(self, d) -> bool:
        """The rows axis: `length` counts every physical row, so ``iota < B`` is true
        everywhere; which cells are real the frame says, and inside a packed scan ``alive``.
        Kept, that always-true mask cost the packed GRU's backward loop five loop-invariant
        masks carried through it and an ``and`` in each of its twelve per-step selects."""
        return is_sym(d) and str(d) == self.rows_name

    def per_row(self, d, *, as_value: bool = False):
        raise NoRule(f"the length {d} is per row, and a packed row holds several sequences")

    def own_length(self, eqn, d, rows: str):
        """Each sequence's own, held at every cell of it (`PerSequence`)."""
        return PerSequence(self._at(d, self.seglen, as_value=True), None)

    def count(self, d):
        if self.var in dim_vars(d):
            return self.length(d)
        # The rows as a number are the sequences, not the packed rows.
        return lax.convert_element_type(evaluate_dim(d, self.sizes), np.int32)

    # -- the families' operations (see `Ctx.reduce`): within each sequence ---------------------

    def reduce(self, eqn, invals, fills, axes):
        return _reduction(self, eqn, invals, fills, axes)

    def accumulate(self, eqn, x, axis: int, monoid, reverse: bool):
        return _cumulative(self, eqn, x, axis, monoid, reverse)

    def reverse(self, x, axis: int):
        return _reversed_sequences(self, x, axis)

    def window(self, eqn, x, monoid):
        return _window(self, eqn, x, monoid)

    def top_k(self, eqn, x, axis: int):
        return _top_per_sequence(self, eqn, x, axis)

    def check_relayout(self, src, dst) -> None:
        """Merging or splitting the rows or a packed length would mix a row's sequences."""
        if self.row_axes(src) or self.row_axes(dst):
            raise NoRule("a reshape that merges or splits the rows or a packed length")

    def sort_key(self, shape, axis: int):
        """Each cell in a sequence's frame keys by its sequence's start column, any other by
        its own column: every sequence is sorted in place, every other cell stays put.
        (``argsort``'s positions are each cell's own, by the ``iota`` rule; the gradient's
        gather and scatter-add by that permutation are `_pick_cells` and `_put_cells`.)"""
        rows, packed = self.row_axes(shape), self.packed_axes(shape)
        if axis not in packed:
            raise NoRule("a sort over the rows of packed rows")
        if len(rows) != 1 or len(packed) != 1:
            raise NoRule(f"a sort of a value of shape {tuple(shape)}, which mixes sequences of "
                         f"a packed row")
        return spread(self.starts(shape[axis]), shape, (rows[0], axis))

    # -- what `evaluate` asks of a layout (see `Ctx`) ---------------------------------------

    def held_outputs(self, eqn, invals) -> list | None:
        """A value that cannot be packed makes whatever reads it unpackable, at its line."""
        marker = next((x for x in invals if isinstance(x, NotPacked)), None)
        if marker is not None:
            self.flag(eqn, f"reads {marker.why}")
            return [marker] * len(eqn.outvars)
        if any(isinstance(x, RowVarying) for x in invals):   # never made here; defensive
            self.flag(eqn, "reads a per-row value")
            return [NotPacked("a per-row value")] * len(eqn.outvars)
        return None

    def held_rule(self, eqn, invals):
        if any(isinstance(x, PerCell) for x in invals):
            return _per_cell
        if any(isinstance(x, PerSequence) for x in invals):
            return _evaluate_per_sequence
        return None

    def refusal(self, eqn, invals) -> str | None:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            for d in shape:
                if not self.recorder.monotone(d) or not _fits(self.recorder, d, self.var,
                                                               self.rows_name, self.room):
                    return (f"the length {d} can exceed its sequence's room in a packed row "
                            f"(a packed row leaves {self.room} cell(s) after each sequence; "
                            f"T + c with a constant c packs)")
                # A per-position value without rows has no frame to keep.
                if self.row_axes(shape) and not _keeps_start_columns(
                        self.recorder, d, self.var, self.rows_name):
                    return (f"the length {d} is shorter than its sequence by more than a "
                            f"constant (a stride: x[:, ::2], a strided convolution): the "
                            f"part of a sequence that starts mid-row would lie past the end "
                            f"of the shorter packed row, so its outputs cannot start at its "
                            f"own column")
        return moves_ragged_rows(self, eqn)

    def rule_for(self, eqn, entry):
        return entry.packed if entry is not None and entry.packed is not None else _generic

    def refused(self, eqn, invals, why: str) -> list:
        """Flagged: the plan cannot pack (it runs padded), and what reads the outputs says so."""
        self.flag(eqn, why)
        return [NotPacked(why)] * len(eqn.outvars)

    def without_rule(self, eqn, invals, error: NoRule) -> list:
        return self.refused(eqn, invals, str(error))

    def as_output(self, x, aval):
        if isinstance(x, (NotPacked, PerCell)):
            return x
        if isinstance(x, PerSequence):
            return PerSequence(like_aval(x.value, aval), x.axis)
        return like_aval(x, aval)

    def positions_of(self, eqn, reading):
        return _positions_recipe(eqn, reading)

    def without_rows(self, eqn, invals) -> list:
        """An elementwise equation of a per-sequence number and positions, without the rows
        axis (``jnp.arange(T) / T``): per cell (`PerCell`)."""
        return _per_cell(self, eqn, invals)

    def per_sequence(self, eqn, what: str) -> list:
        where = equation_line(eqn) or "<unknown>"
        return [NotPacked(f"{what} made at {where}, a per-sequence value (a packed row holds "
                          f"several sequences)")] * len(eqn.outvars)


def _along(v2, ndim: int, rows_axis: int, packed_axis: int):
    """A ``(rows, cells)`` array shaped to broadcast against a value of rank ``ndim`` whose
    rows and packed axes are those."""
    if rows_axis > packed_axis:
        v2 = v2.T
    return jnp.expand_dims(v2, [a for a in range(ndim) if a not in (rows_axis, packed_axis)])


def _for_every_length(recorder: Recorder, what: str, d, var: str, rows: str,
                      holds: Callable[[list[tuple[int, int]]], bool]) -> bool:
    """Whether ``holds`` the ``(n, d(n))`` pairs of a packed length ``d`` for every ``n``
    within the variable's bounds (cached per ``what`` and ``d``); true of a length that is no
    packed one, false of one that mixes variables or has too many lengths to check."""
    names = dim_vars(d)
    if var not in names or rows in names:
        return True
    key = (what, d)
    if key not in recorder._monotone:
        ok = names == {var}
        if ok:
            lo, hi = dim_bounds(var_dim(var, d.scope))
            ok = bool(np.isfinite(hi) and hi - lo <= 1 << 14) and holds(
                [(n, int(evaluate_dim(d, {var: n}))) for n in range(max(int(lo), 0), int(hi) + 1)])
        recorder._monotone[key] = bool(ok)
    return recorder._monotone[key]


def _fits(recorder: Recorder, d, var: str, rows: str, room: int) -> bool:
    """Whether a packed length never exceeds its sequence and the ``room`` cells after it:
    ``d(n) <= n + room`` for every n within the variable's bounds (a sequence's part of the
    axis stays inside its own cells)."""
    return _for_every_length(recorder, ("fits", room), d, var, rows,
                             lambda pairs: all(e <= n + room for n, e in pairs))


def room_of(d, var: str) -> int:
    """The cells a packed length needs after each sequence: ``c`` for ``T + c`` (``c > 0``;
    ``jnp.pad`` by one cell each side gives ``T + 2``), else 0 -- ``T`` and ``T - 1`` need
    none, and a length that exceeds ``T`` by more than a constant (``2*T``) has no room that
    would do (`_PackedCtx.refusal` refuses it).

    >>> import jax
    >>> T, = jax.export.symbolic_shape("T")
    >>> room_of(T + 2, "T"), room_of(T - 1, "T"), room_of(2 * T, "T")
    (2, 0, 0)
    """
    if not is_sym(d) or dim_vars(d) != {var}:
        return 0
    excess = d - var_dim(var, d.scope)
    return int(excess) if not is_sym(excess) and int(excess) > 0 else 0


def _room_needed(jaxpr, var: str) -> int:
    """The room a packed program leaves after each sequence: the largest `room_of` any value
    of ``jaxpr`` (every program inside it included) has along the packed variable ``var``."""
    room, stack = 0, [jaxpr]
    while stack:
        j = stack.pop()
        values = [*j.invars, *(v for eqn in j.eqns for v in eqn.outvars)]
        for v in values:
            for d in getattr(getattr(v, "aval", None), "shape", ()):
                room = max(room, room_of(d, var))
        stack.extend(p for eqn in j.eqns for p in sub_jaxprs(eqn.params))
    return room


def _keeps_start_columns(recorder: Recorder, d, var: str, rows: str) -> bool:
    """Whether a packed length ``e`` leaves room for every sequence's part at the sequence's
    own start column (the frame): a sequence of ``n`` cells starting at column ``c`` of a row
    of ``L >= c + n`` columns needs ``c + e(n) <= e(L)`` when it has any position, that is
    ``e(m) - m`` never decreasing where ``e(m) > 0``. ``T - 1`` and ``max(T - 2, 0)`` keep
    it; ``ceil(T / 2)`` (a stride) and ``min(T, k)`` do not."""
    def slack_never_decreases(pairs):
        slack = [e - n for n, e in pairs if e > 0]
        return all(a <= b for a, b in zip(slack, slack[1:]))
    return _for_every_length(recorder, "keeps start columns", d, var, rows,
                             slack_never_decreases)


# --------------------------------------------------------------------------------------------
# Rules

def _scatter_window(eqn) -> list:
    """A scatter's window along each operand axis: 1 where a dimension is inserted (or
    batched), else the update's window sizes in order."""
    dn, update_shape = eqn.params["dimension_numbers"], eqn.invars[2].aval.shape
    sizes = iter(update_shape[d] for d in dn.update_window_dims)
    return [1 if a in dn.inserted_window_dims or a in dn.operand_batching_dims else next(sizes)
            for a in range(len(eqn.invars[0].aval.shape))]


def _generic(ctx: _PackedCtx, eqn, invals):
    """A primitive without a packed rule of its own, by what its entry says of it: elementwise
    (per cell, after jnp's implicit broadcasts), a call or a branch (its equations meet the
    packed values), an indexing rule (a window or a scatter: the padded rule, whose bounds read
    each sequence's own length through `length`), or else refused."""
    name = eqn.primitive.name
    entry = lookup_rule(eqn.primitive)
    if entry is None or entry.rule is None:
        raise NoRule(f"no rule for {name} on a length axis")
    if entry.rule is ELEMENTWISE:
        return _implicit_broadcasts(ctx, eqn, invals)
    if entry.structural:
        return entry.rule(ctx, eqn, invals)
    if name in SCATTERS and ctx.alive is not None:
        invals = _drop_dead_rows(ctx, eqn, invals)
    if entry.window is not None or name in SCATTERS:
        # Their rules bound indices by lengths read through `length`, which refuses a length
        # that differs per sequence; indexing feature axes passes unchanged. A window that
        # starts at a literal 0 bounds nothing, so it is refused here: ``x[:, :k]`` would read
        # each packed row's first sequence for all of the row's sequences.
        _refuse_windows_of_packed_length(ctx, eqn)
        _refuse_indexing_across_sequences(ctx, eqn)
        return entry.rule(ctx, eqn, invals)
    raise NoRule(f"{name} has no rule for packed rows")


def _refuse_indexing_across_sequences(ctx: _PackedCtx, eqn) -> None:
    """`NoRule` for an indexing equation over packed rows that the padded rule would run by
    column, mixing a row's sequences:

    - an operand made per position without the rows axis (``jnp.arange(T) // 2`` as segment
      ids under ``jax.vmap``) beside packed rows: its entries would be read by column, not by
      each cell's position in its sequence;
    - a scatter of a packed length's cells into a value with the rows but without a packed
      length (``jax.ops.segment_sum`` along T into segments, per row): each packed row would
      sum its sequences together. (Into a value without the rows -- an embedding's gradient --
      every real cell of every row adds up, as in the pad layout.)"""
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars)]
    if not any(ctx.row_axes(s) for s in shapes):
        return                       # per-position code: no packed row to mix
    name = eqn.primitive.name
    for shape in shapes[:len(eqn.invars)]:
        if ctx.packed_axes(shape) and not ctx.row_axes(shape):
            raise NoRule(f"{name} reads a value made per position without the rows axis (such "
                         f"as jnp.arange(T) // 2) beside packed rows: it would be read by "
                         f"column, not by each cell's position in its sequence")
    if name in SCATTERS:
        operand, updates = shapes[0], shapes[2]
        if (ctx.row_axes(updates) and ctx.packed_axes(updates) and ctx.row_axes(operand)
                and not ctx.packed_axes(operand)):
            raise NoRule(f"{name} collects the cells of a packed length into a value without "
                         f"one (jax.ops.segment_sum along T): each packed row would combine "
                         f"its sequences")


def _refuse_windows_of_packed_length(ctx: _PackedCtx, eqn) -> None:
    """`NoRule` for an indexing equation whose window along a packed length has a fixed size
    (``x[:, :k]``, ``r[:k]`` under ``jax.vmap``, their transposes): one window per packed row,
    where each sequence needs its own; or that indexes the rows (``x.at[0].set``)."""
    shape = eqn.invars[0].aval.shape
    p = eqn.params
    # Batching axes (``take_along_axis``) pair each position with its own index.
    batching = getattr(p.get("dimension_numbers"), "operand_batching_dims", ())
    if eqn.primitive.name in ("gather", "dynamic_slice"):
        window = p["slice_sizes"]
    elif eqn.primitive.name == "dynamic_update_slice":
        window = eqn.invars[1].aval.shape
    else:
        window = _scatter_window(eqn)
    for a in set(ctx.row_axes(shape)) - set(batching):
        if not _core_equal(window[a], shape[a]):
            raise NoRule("an index into the rows of packed rows (x.at[0]): a packed row holds "
                          "several sequences")
    for a in set(ctx.packed_axes(shape)) - set(batching):
        # A window of T - c from a constant start keeps each sequence's start column, as
        # ``x[:, 1:]`` does (the module's frame); a constant or capped one (``min(T, k)``)
        # covers the row's first columns only.
        if not is_sym(window[a]) or is_sym(shape[a] - window[a]):
            raise NoRule("a window of a packed length of a fixed size (x[:, :k]), or positions "
                          "picked by a stride (x[:, ::2]): one set of columns per packed row, "
                          "where each sequence needs its own")


def _drop_dead_rows(ctx: _PackedCtx, eqn, invals):
    """Inside a packed scan: the updates of rows whose cell is not real become the combiner's
    identity, so they change nothing (a plain scatter cannot be told to skip them)."""
    x, idx, updates = invals
    dn = eqn.params["dimension_numbers"]
    axes = [d for d in ctx.row_axes(updates.shape) if d not in dn.update_window_dims]
    if not axes:
        return invals
    family = SCATTERS[eqn.primitive.name]
    if family is None:
        raise NoRule("a scatter from the rows inside a scan over packed rows")
    identity = family.identity(updates.dtype)
    keep = lax.broadcast_in_dim(ctx.alive, updates.shape, (axes[0],))
    return [x, idx, lax.select(keep, updates, filled(updates.shape, identity, updates.dtype))]


def _implicit_broadcasts(ctx: _PackedCtx, eqn, invals):
    """Elementwise operands of a unit rows axis (``x + pe[:T]`` adds ``(B, T)`` and ``(1, T)``
    with no ``broadcast_in_dim`` between): a per-position value broadcast over the rows,
    placed by position like `_broadcast_in_dim` places it."""
    out = getattr(eqn.outvars[0].aval, "shape", ())
    rows, packed = ctx.row_axes(out), ctx.packed_axes(out)
    if len(rows) != 1 or len(packed) not in (1, 2):
        return None
    r = rows[0]
    changed, new = False, []
    for x in invals:
        if jnp.ndim(x) != len(out) or eqn.primitive.name in ("transpose", "squeeze") or not all(
                not is_sym(d) and d == 1 or _core_equal(d, o) for d, o in zip(x.shape, out)):
            new.append(x)           # not lined up with the output axis by axis
            continue
        along = [t for t in packed if t in ctx.packed_axes(x.shape)]
        if along and not is_sym(x.shape[r]):
            dims = tuple(a for a in range(len(out)) if a != r)
            shape = tuple(out[r] if a == r else d for a, d in enumerate(x.shape))
            x = _by_position(ctx, lax.squeeze(x, (r,)), dims, shape, r, along)
            changed = True
        new.append(x)
    return bind_eqn(eqn, new) if changed else None


def _reduction(ctx: _PackedCtx, eqn, invals, fills, axes):
    """`_PackedCtx.reduce`: over every real cell, within each sequence, or per position."""
    x, axes = invals[0], set(axes)
    rows, packed = set(ctx.row_axes(x.shape)), set(ctx.packed_axes(x.shape))
    arg = eqn.primitive.name in ("argmax", "argmin")
    padded = functools.partial(Ctx.reduce, ctx, eqn, invals, fills, tuple(axes))
    if not rows:                       # per position: real up to the longest sequence
        return padded()
    if len(packed) == 2:               # pairs of cells (attention's scores): within a sequence
        if rows <= axes and not axes & packed and _SEGMENT.get(eqn.primitive.name):
            return [_over_positions(ctx, eqn, x, *rows, *sorted(packed))]
        if arg or not (axes & packed == packed if rows <= axes else len(axes & packed) == 1):
            return ctx.per_sequence(eqn, f"{eqn.primitive.name} over part of a packed value")
        n = len(fills)
        return bind_eqn(eqn, [*(ctx.frame_only(v, f) for v, f in zip(invals[:n], fills)),
                           *invals[n:]])
    if packed:
        if rows | packed <= axes and not arg:
            return padded()                     # over every real cell
        if packed <= axes and not rows & axes and eqn.primitive.name != "reduce":
            return [_along_sequences(ctx, eqn, x, *rows, *packed)]
        if rows <= axes and not packed & axes and _SEGMENT.get(eqn.primitive.name):
            return [_over_positions(ctx, eqn, x, *rows, *sorted(packed))]
        return ctx.per_sequence(eqn, f"{eqn.primitive.name} over part of a packed value")
    if ctx.alive is not None and not arg:       # inside a packed scan: over its real rows
        return padded()
    return ctx.per_sequence(eqn, f"{eqn.primitive.name} over the rows")


# How a reduction along the length combines each sequence's cells (`_along_sequences`).
_SEGMENT = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "mul",
            "reduce_and": "min", "reduce_or": "max", "reduce_xor": None}


def _along_sequences(ctx: _PackedCtx, eqn, x, r: int, p: int) -> PerSequence:
    """A reduction along a packed length that keeps the rows (``jnp.sum(x, axis=1)``,
    ``jnp.argmax(logits, axis=1)``): per sequence, over its own cells -- a scatter into each
    sequence's start column, read back at every cell of the sequence. ``argmax``/``argmin``
    give the position inside the sequence (its first extreme, or its first NaN, as jnp)."""
    name = eqn.primitive.name
    if _SEGMENT.get(name, "") is None:
        raise NoRule(f"{name} along a packed length")
    frame = ctx.frame(x.shape)
    axes = tuple(eqn.params["axes"])
    if name in ("argmax", "argmin"):
        best = "max" if name == "argmax" else "min"
        nan = jnp.isnan(x) & frame if jnp.issubdtype(x.dtype, jnp.inexact) else frame & False
        fill = REDUCERS[name].identity(x.dtype)
        clean = lax.select(frame & ~nan, x, filled(x.shape, fill, x.dtype))
        extreme = _segments(ctx, clean, r, p, best, fill)
        has_nan = _segments(ctx, nan.astype(np.int8), r, p, "max", 0)
        at = functools.partial(_read_cells, ctx, ctx.starts(x.shape[p], 0), r, p)
        hit = frame & jnp.where(at(has_nan) > 0, nan, clean == at(extreme))
        position = spread(ctx.cells(x.shape[p])[0], x.shape, (r, p))
        big = np.iinfo(np.int32).max
        first = _segments(ctx, jnp.where(hit, position, big).astype(np.int32), r, p, "min", big)
        out = jnp.where(first == big, 0, first).astype(eqn.params["index_dtype"])
    else:
        fill = REDUCERS[name].identity(x.dtype)
        x = lax.select(frame, x, filled(x.shape, fill, x.dtype))
        x, (r, p) = _others_first(eqn, x, axes, (r, p))
        exact = x.dtype == np.bool_
        out = _segments(ctx, x.astype(np.int8) if exact else x, r, p, _SEGMENT[name],
                        int(fill) if exact else fill)
        out = out.astype(x.dtype)
    (r_out,) = ctx.row_axes(eqn.outvars[0].aval.shape)
    return by_cell(out, r_out)


def _others_first(eqn, x, axes, kept):
    """Reduction ``eqn`` of ``x`` over its ``axes`` other than ``kept``, per cell, and where
    the ``kept`` axes are after it: the reduction along the packed axes comes next."""
    others = tuple(a for a in axes if a not in kept)
    if not others:
        return x, tuple(kept)
    return (bind_eqn_with(eqn, [x], axes=others)[0],
            tuple(k - sum(a < k for a in others) for k in kept))


def _over_positions(ctx: _PackedCtx, eqn, x, r: int, *packed: int):
    """A reduction over the rows that keeps the packed lengths (the gradient of a learned
    ``pe[:T]`` added to every row, or of a ``(T, T)`` position bias added to attention's
    scores): per position, over the cells of every sequence at that position (one packed axis)
    or pair of positions (two) -- a scatter by position, as the pad layout reduces each
    position over the rows long enough to hold it. A position no sequence reaches holds the
    identity, as padded."""
    name = eqn.primitive.name
    fill = REDUCERS[name].identity(x.dtype)
    x = lax.select(ctx.frame(x.shape), x, filled(x.shape, fill, x.dtype))
    x, (r, *packed) = _others_first(eqn, x, eqn.params["axes"], (r, *packed))
    exact = x.dtype == np.bool_
    xs = jnp.moveaxis(x.astype(np.int8) if exact else x, (r, *packed), range(1 + len(packed)))
    sizes = xs.shape[1:1 + len(packed)]
    index = []
    for k, n in enumerate(sizes):       # (rows, n) positions, spread over the pair's axes
        pos, _ = ctx.cells(n)
        at = jnp.where(ctx.in_frame(n), pos, n)                      # n: dropped
        index.append(jnp.expand_dims(at, [1 + j for j in range(len(sizes)) if j != k]))
    total = filled((*sizes, *xs.shape[1 + len(packed):]), int(fill) if exact else fill, xs.dtype)
    out = getattr(total.at[tuple(index)], _SEGMENT[name])(xs, mode="drop").astype(x.dtype)
    return jnp.moveaxis(out, range(len(packed)), [p - (r < p) for p in packed])


def _segments(ctx: _PackedCtx, x, r: int, p: int, how: str, fill):
    """``(rows, columns, *rest)``: per cell of the grid, ``how`` ("add", "max", ...) of its
    sequence's cells of ``x`` (rows axis ``r``, packed axis ``p``; cells outside the frame
    already hold ``fill``): a scatter into each sequence's start column, read back at every
    cell of the sequence."""
    rows, columns = ctx.pos.shape
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    n = xs.shape[1]
    row = lax.broadcasted_iota(np.int32, (rows, n), 0)
    into = jnp.where(ctx.in_frame(n), ctx.starts(n), columns)      # columns: dropped
    total = filled((rows, columns, *xs.shape[2:]), fill, xs.dtype)
    total = getattr(total.at[row, into], how)(xs, mode="drop")
    return _read_cells(ctx, ctx.sequence_starts(), 0, 1, total)


def _read_cells(ctx: _PackedCtx, starts, r, p, grid):
    """A ``(rows, columns, *rest)`` grid of per-sequence entries (at each sequence's start
    column) read at cells whose starts are ``starts`` (``(rows, n)``), with the rows and the
    cells going to axes ``r`` and ``p``."""
    row = lax.broadcasted_iota(np.int32, jnp.shape(starts), 0)
    return jnp.moveaxis(grid[row, starts], (0, 1), (r, p))


@defrule("dot_general", layout="pack")
def _dot_general(ctx: _PackedCtx, eqn, invals):
    lhs, rhs = invals
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    if len(ctx.row_axes(out)) > 1:
        raise NoRule("a contraction pairing the rows of packed rows")
    if ctx.row_axes(out) and ctx.packed_axes(out) and any(
            ctx.packed_axes(x.shape) and not ctx.row_axes(x.shape) for x in invals):
        return _placed_contraction(ctx, eqn, lhs, rhs)
    if len(ctx.packed_axes(out)) > 1 or any(len(ctx.packed_axes(x.shape)) > 1 for x in invals):
        return _pairing(ctx, eqn, lhs, rhs)
    for x, contracted in ((lhs, lc), (rhs, rc)):
        rows, packed = set(ctx.row_axes(x.shape)), set(ctx.packed_axes(x.shape))
        c = set(contracted)
        if packed & c and not rows <= c:
            pooled = _along_each_sequence(ctx, eqn, lhs, rhs)
            if pooled is not None:
                return pooled
            return ctx.per_sequence(eqn, "a contraction over a packed length alone")
        if rows & c and not packed <= c:
            return ctx.per_sequence(eqn, "a contraction over the rows alone")
        if rows & c and not packed and ctx.alive is None:
            return ctx.per_sequence(eqn, "a contraction over the rows")
    return padded_rule(eqn)(ctx, eqn, invals)


def _placed_contraction(ctx: _PackedCtx, eqn, lhs, rhs):
    """A per-position operand contracted with packed rows into packed rows (a ``(T, T)``
    matrix: ``einsum("ts,bsf->btf", jnp.tri(T), x)`` for running sums, a fixed mixing matrix):
    placed into the rows by position first (`_by_position`: each cell its own positions),
    then batched over the rows with the other operand. A contraction over a packed length
    then reads each sequence's own cells only, as attention's ``w @ v`` does."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k = 0 if not ctx.row_axes(lhs.shape) else 1            # the per-position operand
    fixed, rows_value = (lhs, rhs) if k == 0 else (rhs, lhs)
    (fc, vc), (fb, vb) = ((lc, rc), (lb, rb)) if k == 0 else ((rc, lc), (rb, lb))
    rows = ctx.row_axes(rows_value.shape)
    if len(rows) != 1 or rows[0] in vc or rows[0] in vb or ctx.row_axes(fixed.shape):
        raise NoRule("a contraction of a per-position value into packed rows, not one rows "
                      "axis kept free")
    (r,) = rows
    packed = [1 + a for a in ctx.packed_axes(fixed.shape)]
    placed = _by_position(ctx, fixed, tuple(range(1, fixed.ndim + 1)),
                          (rows_value.shape[r], *fixed.shape), 0, packed)
    fc, fb, vb = tuple(a + 1 for a in fc), (0, *(a + 1 for a in fb)), (r, *vb)
    operands = [placed, rows_value]
    if set(packed) & set(fc):          # over a packed length: within each sequence only
        operands = [ctx.frame_only(x, 0) for x in operands]
    numbers = ((fc, vc), (fb, vb)) if k == 0 else ((vc, fc), (vb, fb))
    (out,) = bind_eqn_with(eqn, operands if k == 0 else operands[::-1],
                        dimension_numbers=numbers)
    # The rows came out first (a batch axis): back among the free axes, where they were.
    free = [d for d in range(rows_value.ndim) if d not in vc and d not in vb[1:]]
    before = fixed.ndim - len(fc) - len(fb) + 1 if k == 0 else 0
    return [jnp.moveaxis(out, 0, len(lb) + before + free.index(r))]


def _along_each_sequence(ctx: _PackedCtx, eqn, lhs, rhs):
    """A contraction along a packed length alone, batched over the rows (attention pooling,
    ``einsum("bt,btf->bf", w, x)``): per sequence, over its own cells -- the products per
    cell (the length made a batch axis too), summed per sequence like `_along_sequences`.
    None for another contraction."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    (lr, rr), (lp, rp) = ((ctx.row_axes(x.shape) for x in (lhs, rhs)),
                          (ctx.packed_axes(x.shape) for x in (lhs, rhs)))
    if not (len(lr) == len(rr) == len(lp) == len(rp) == 1 and lr[0] in lb and rr[0] in rb
            and lb.index(lr[0]) == rb.index(rr[0]) and lp[0] in lc and rp[0] in rc
            and lc.index(lp[0]) == rc.index(rp[0])):
        return None
    i = lc.index(lp[0])
    first = lambda b, r: (r, *(d for d in b if d != r))      # noqa: E731 - the rows first
    numbers = ((lc[:i] + lc[i + 1:], rc[:i] + rc[i + 1:]),
               ((*first(lb, lr[0]), lp[0]), (*first(rb, rr[0]), rp[0])))
    (cells,) = bind_eqn_with(eqn, [ctx.frame_only(lhs, 0), ctx.frame_only(rhs, 0)],
                          dimension_numbers=numbers)
    # cells: (rows, other batch axes..., length, free axes...): each sequence's own sum.
    grid = _segments(ctx, cells, 0, len(lb), "add", 0)
    return [by_cell(grid, lb.index(lr[0]))]


def _pairing(ctx: _PackedCtx, eqn, lhs, rhs):
    """A contraction inside each packed row that pairs its cells: attention's scores
    ``q @ k.T`` (over features: every pair, those of two sequences outside the frame) and
    their use ``w @ v`` (over a packed length: each cell's own sequence only, both operands
    zero outside the frame)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lr, rr = ctx.row_axes(lhs.shape), ctx.row_axes(rhs.shape)
    if not (lr and rr and lr[0] in lb and rr[0] in rb and lb.index(lr[0]) == rb.index(rr[0])):
        raise NoRule("a contraction pairing cells of packed rows, not batched over the rows")
    lp, rp = ctx.packed_axes(lhs.shape), ctx.packed_axes(rhs.shape)
    if any((a in lp) != (b in rp) for a, b in zip(lc, rc)):
        raise NoRule("a contraction of a packed length with another axis")
    if not any(a in lp for a in lc):
        return None
    if not ctx.packed_axes(eqn.outvars[0].aval.shape):
        return ctx.per_sequence(eqn, "a contraction over packed lengths")
    return bind_eqn(eqn, [ctx.frame_only(x, 0) for x in (lhs, rhs)])


@defrule("conv_general_dilated", layout="pack")
def _conv(ctx: _PackedCtx, eqn, invals):
    """A convolution along a packed length with stride 1: every tap reads its own sequence,
    and zeros beyond its edges, as the exact-size convolution's zero padding does. The
    convolution becomes one per tap ``k``: the operand shifted by ``k * dilation - low`` with
    the cells whose tap falls outside their sequence zeroed, convolved with tap ``k`` alone.
    Its transposes are the same two forms: the input gradient is again a convolution over the
    length (the kernel reversed); the kernel gradient pairs the input with the output
    gradient over the length (window = the length, one output per tap)."""
    lhs, rhs = invals
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    spatial = [i for i, a in enumerate(lhs_spec[2:]) if a in ctx.packed_axes(lhs.shape)]
    rows = ctx.row_axes(lhs.shape)
    if not spatial:
        if any(ctx.packed_axes(x.shape) for x in invals) or rows == [lhs_spec[1]]:
            raise NoRule("a convolution over the rows or with a packed kernel, not along a "
                          "packed length")
        return None          # rows as the batch, the length not convolved: per position
    (i,) = spatial
    la, ra, oa = lhs_spec[2 + i], rhs_spec[2 + i], out_spec[2 + i]
    lo, hi = p["padding"][i]
    if is_sym(lo) or is_sym(hi) or p["lhs_dilation"][i] != 1 or any(
            is_sym(x.shape[a]) for x in invals for a in range(x.ndim)
            if a not in (*ctx.row_axes(x.shape), *ctx.packed_axes(x.shape))):
        raise NoRule("a convolution along a packed length with a length-dependent or "
                      "input-dilated padding, or over another length")
    if rows == [lhs_spec[0]] and not is_sym(rhs.shape[ra]):
        # Along the length: the forward pass and the input gradient.
        if p["window_strides"][i] != 1 or p["batch_group_count"] != 1:
            raise NoRule("a strided or batch-grouped convolution along a packed length (each "
                          "sequence's outputs would start at another column, or mix rows)")
        taps, step, length = rhs.shape[ra], p["rhs_dilation"][i], eqn.outvars[0].aval.shape[oa]
        out = None
        for k in range(taps):
            x = _tap(ctx, lhs, rows[0], la, k * step - lo, length)
            (y,) = bind_eqn_with(eqn, [x, lax.slice_in_dim(rhs, k, k + 1, axis=ra)],
                              padding=_replace(p["padding"], i, (0, 0)),
                              rhs_dilation=_replace(p["rhs_dilation"], i, 1))
            out = y if out is None else out + y
        return [out]
    if (rows == [lhs_spec[1]] and ctx.row_axes(rhs.shape) == [rhs_spec[1]]
            and ctx.packed_axes(rhs.shape) == [ra] and not is_sym(eqn.outvars[0].aval.shape[oa])):
        # The kernel gradient: input and output gradient paired over the rows and the length.
        if p["rhs_dilation"][i] != 1 or p["feature_group_count"] != 1:
            raise NoRule("the kernel gradient of a strided or feature-grouped convolution along "
                          "a packed length")
        length, step = rhs.shape[ra], p["window_strides"][i]
        rhs = ctx.frame_only(rhs, 0)
        outs = []
        for k in range(eqn.outvars[0].aval.shape[oa]):
            x = _tap(ctx, lhs, rows[0], la, k * step - lo, length)
            outs += bind_eqn_with(eqn, [x, rhs], window_strides=_replace(p["window_strides"], i, 1),
                               padding=_replace(p["padding"], i, (0, 0)))
        return [lax.concatenate(outs, oa)]
    raise NoRule("a convolution pairing packed rows in another way (not along the length "
                  "with the rows as its batch, nor a kernel gradient over them)")


def _tap(ctx: _PackedCtx, x, rows_axis: int, axis: int, offset: int, length, fill=0):
    """``x`` read along its packed ``axis`` at ``offset`` from each cell of an axis of packed
    ``length``: cell ``c`` holds ``x[c + offset]`` where that is the same sequence's position
    ``pos(c) + offset`` (inside its part of ``x``), ``fill`` elsewhere."""
    n = x.shape[axis]
    high = length - n + offset
    if is_sym(high):
        raise NoRule(f"a convolution between packed lengths {n} and {length} that differ by "
                      f"a length")
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (-offset, int(high), 0)
    shifted = lax.pad(x, filled((), 0, x.dtype), config)
    pos, seglen = ctx.cells(length)
    source = pos + offset
    real = ctx.in_frame(length) & (source >= 0) & (source < ctx._at(n, seglen))
    return lax.select(spread(real, shifted.shape, (rows_axis, axis)), shifted,
                      filled(shifted.shape, fill, x.dtype))


def _window(ctx: _PackedCtx, eqn, x, monoid):
    """`_PackedCtx.window`: a window along a packed length with stride 1 (a moving sum,
    average, max or min): each window reads its own sequence and the combiner's identity past
    its edges, as the exact-size window reads its init value there. The window becomes one tap
    per offset, combined. A stride would start each sequence's outputs at another column, so
    it is refused, as is a window across the rows or another axis. Gradients do not pack: a sum
    window's pads the length past each sequence's room, a max window's selects and scatters
    (``select_and_scatter_add``, no rule)."""
    p = eqn.params
    rows, packed = ctx.row_axes(x.shape), ctx.packed_axes(x.shape)
    moved = [a for a in range(x.ndim) if p["window_dimensions"][a] != 1
             or p["window_strides"][a] != 1 or tuple(p["padding"][a]) != (0, 0)
             or p["base_dilation"][a] != 1 or p["window_dilation"][a] != 1]
    if not any(a in packed for a in moved):
        if any(a in rows or is_sym(x.shape[a]) for a in moved):
            raise NoRule("a window over the rows of packed rows, or over another length")
        return None                             # feature axes only: per position
    if len(rows) != 1 or len(packed) != 1 or len(moved) != 1:
        raise NoRule("a window along a packed length and another axis")
    (a,) = moved
    lo, hi = p["padding"][a]
    if p["window_strides"][a] != 1 or p["base_dilation"][a] != 1 or is_sym(lo) or is_sym(hi):
        raise NoRule("a strided, base-dilated or length-padded window along a packed length "
                      "(each sequence's outputs would start at another column)")
    combine, identity = monoid
    fill, step, length = identity(x.dtype), p["window_dilation"][a], eqn.outvars[0].aval.shape[a]
    out = None
    for k in range(p["window_dimensions"][a]):
        tap = _tap(ctx, x, rows[0], a, k * step - lo, length, fill)
        out = tap if out is None else combine(out, tap)
    return [out]


def _replace(values, i, value):
    values = list(values)
    values[i] = value
    return tuple(values)


def _reversed_sequences(ctx: _PackedCtx, x, a: int):
    """`_PackedCtx.reverse`: reversing a packed length reverses each sequence in place: the
    cell at position ``p`` of a part of ``e`` cells reads its own sequence's position
    ``e - 1 - p``, at column ``start + e - 1 - p``; cells outside the frame keep their own. A
    reverse is its own transpose, so gradients come back through this rule too."""
    rows, packed = ctx.row_axes(x.shape), ctx.packed_axes(x.shape)
    if a not in packed:
        raise NoRule("a reverse over the rows of packed rows, or over another length")
    if len(rows) != 1 or len(packed) != 1:
        raise NoRule(f"a reverse of a value of shape {tuple(x.shape)}, which mixes sequences "
                      f"of a packed row")
    return _reverse(ctx, x, rows[0], a)


def _reverse(ctx: _PackedCtx, x, r: int, a: int, others=()):
    """``x`` (rows axis ``r``) with each sequence reversed in place along its packed axis
    ``a``, and the axes ``others`` reversed as they are."""
    if others:
        x = lax.rev(x, others)
    n = x.shape[a]
    pos, seglen = ctx.cells(n)
    column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
    source = jnp.where(ctx.in_frame(n), column - 2 * pos + ctx._at(n, seglen) - 1, column)
    return take_rows(ctx, x, spread(source, x.shape, (r, a)), a)


def _top_per_sequence(ctx: _PackedCtx, eqn, x, a: int):
    """`_PackedCtx.top_k`: each sequence's own ``k`` largest and their positions, held at
    every cell of the sequence (`PerSequence`). Each sequence is sorted in place (its start
    column the first key, `sort_key`), ascending by value and, among equal values, descending
    by position, so its ``k`` largest are its last ``k`` cells read backwards, the lower
    position first among ties, as ``top_k`` breaks them. A sequence shorter than ``k`` gets
    the dtype's lowest value at positions ``n .. k - 1``, as its padded row does."""
    shape, k = x.shape, int(eqn.params["k"])
    if ctx.row_axes(shape) != [0] or ctx.packed_axes(shape) != [a] or a != len(shape) - 1:
        raise NoRule(f"top_k of a value of shape {tuple(shape)} (packed rows take it with the "
                      f"rows first and the packed length last)")
    n = shape[a]
    position = spread(ctx.cells(n)[0], shape, (0, a))
    _, ranked, negated = lax.sort((ctx.sort_key(shape, a), x, -position), dimension=a,
                                  num_keys=3)
    # Per cell of the grid and rank j: the column holding its sequence's j-th largest.
    j = lax.broadcasted_iota(np.int32, (1, 1, k), 2)
    count = ctx._at(n, ctx.seglen)[..., None]
    column = jnp.clip(ctx.sequence_starts()[..., None] + count - 1 - j, 0, n - 1)
    real = (j < count) & (ctx.pos >= 0)[..., None]
    rows = lax.broadcasted_iota(np.int32, column.shape, 0)

    def pick(v):        # (rows, *F, n) -> (rows, columns, *F, k), and where it is real
        got = jnp.moveaxis(jnp.moveaxis(v, a, 1)[rows, column], 2, -1)
        return got, spread(real, got.shape, (0, 1, got.ndim - 1))

    values, keep = pick(ranked)
    values = jnp.where(keep, values, lowest_value(x.dtype))
    positions, _ = pick(-negated)
    positions = jnp.where(keep, positions, lax.broadcasted_iota(
        positions.dtype, positions.shape, positions.ndim - 1))
    return [PerSequence(values, 0), PerSequence(positions.astype(eqn.outvars[1].aval.dtype), 0)]


def _cumulative(ctx: _PackedCtx, eqn, x, a: int, monoid, reverse: bool):
    """`_PackedCtx.accumulate`: a cumulative op along a packed length runs per sequence: a
    scan over the columns whose running value restarts at each sequence's first cell (its last
    with ``reverse=True``, as the transpose of ``cumsum`` runs). Exact, where subtracting each
    sequence's prefix of the row would lose the sequence's own digits; sequential over the row
    length."""
    rows, packed = ctx.row_axes(x.shape), ctx.packed_axes(x.shape)
    if a not in packed:
        raise NoRule(f"{eqn.primitive.name} over the rows of packed rows")
    if len(rows) != 1 or len(packed) != 1:
        raise NoRule(f"{eqn.primitive.name} of a value of shape {tuple(x.shape)}, which mixes "
                      f"sequences of a packed row")
    combine, identity = monoid
    n = x.shape[a]
    pos, seglen = ctx.cells(n)
    restart = pos == (ctx._at(n, seglen) - 1 if reverse else 0)
    columns = jnp.moveaxis(x, a, 0)
    restarts = jnp.moveaxis(spread(restart, x.shape, (rows[0], a)), a, 0)
    start = filled(columns.shape[1:], identity(x.dtype), x.dtype)

    def step(total, cell):
        value, restarts_here = cell
        total = combine(lax.select(restarts_here, start, total), value)
        return total, total

    _, out = lax.scan(step, start, (columns, restarts), reverse=reverse)
    return [jnp.moveaxis(out, 0, a)]


def _position(ctx: _PackedCtx, eqn, shape, index, index_map, window):
    """Where ``x[:, k]`` reads (or its transpose writes) along the packed axis of ``shape``,
    when the equation takes one position of it and every entry of the other axes (``r[k]``
    under ``jax.vmap`` too, which indexes the features at 0): ``(p, position, inside)``, the
    position per grid cell (``k``, or ``n - 1`` for ``x[:, -1]``, whose ``T - 1`` is a number
    per sequence) and whether it is inside the sequence's part of the axis; None for any
    other indexing."""
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    k = len(index_map)
    if (len(rows) != 1 or len(packed) != 1 or tuple(eqn.invars[1].aval.shape) != (k,)
            or packed[0] not in index_map or window[packed[0]] != 1
            or (isinstance(index, PerSequence) and index.axis is not None)
            or any(a != packed[0] and not _core_equal(window[a], shape[a])
                   for a in range(len(shape)))
            or (k > 1 and eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP)):
        return None
    (p,) = packed
    i = list(index_map).index(p)
    if isinstance(index, PerSequence):
        position = index.value[..., i]
    else:
        position = jnp.broadcast_to(jnp.asarray(index)[i], ctx.pos.shape)
    n = ctx._at(shape[p], ctx.seglen)
    inside = (position >= 0) & (position < n)
    if eqn.params["mode"] == lax.GatherScatterMode.CLIP:
        position, inside = jnp.clip(position, 0, n - 1), n > 0
    return p, position.astype(np.int32), inside


def _own_position(ctx: _PackedCtx, eqn, shape, index, index_map, window, batching,
                  index_shape):
    """Where ``take_along_axis(x, (lengths - 1)[:, None, None], 1)`` reads (or its transpose
    writes) along the packed axis of ``shape``: an equation batched over the rows (each
    sequence's entry with its own index) that takes one position of the packed axis and every
    entry of the others, its index a number per sequence. ``(r, p, s, position, inside)``:
    the rows and packed axes, the index's rows axis, the position per grid cell and whether
    it is inside the sequence's part of the axis; None for any other indexing."""
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    operand_batching, index_batching = (tuple(b) for b in batching)
    if len(rows) != 1 or len(packed) != 1 or operand_batching != tuple(rows):
        return None
    (r,), (p,) = rows, packed
    (s,) = index_batching
    if (ctx.row_axes(index_shape) != [s] or tuple(index_map) != (p,) or window[p] != 1
            or any(a not in (r, p) and not _core_equal(window[a], shape[a])
                   for a in range(len(shape)))
            or any(is_sym(d) or d != 1 for a, d in enumerate(index_shape) if a != s)):
        return None
    if not isinstance(index, PerSequence):
        if not hasattr(index, "shape"):
            return None
        index = held(ctx, index, index_shape)
    if index.axis != s:
        return None
    position = jnp.reshape(jnp.moveaxis(index.value, (s, s + 1), (0, 1)), ctx.pos.shape)
    n = ctx._at(shape[p], ctx.seglen)
    inside = (position >= 0) & (position < n)
    if eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        position, inside = jnp.clip(position, 0, jnp.maximum(n - 1, 0)), n > 0
    return r, p, s, position.astype(np.int32), inside


def _pick_own(ctx: _PackedCtx, eqn, invals):
    """``take_along_axis(x, (lengths - 1)[:, None, None], 1)`` of a packed value (the gather
    batched over the rows): each sequence's own position, a per-sequence value; outside the
    sequence (and in a sequence of length 0, which has no cell), the gather's fill."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if isinstance(x, PerSequence) else _own_position(
        ctx, eqn, shape, index, dn.start_index_map, eqn.params["slice_sizes"],
        (dn.operand_batching_dims, dn.start_indices_batching_dims), eqn.invars[1].aval.shape)
    if found is None or not set(dn.collapsed_slice_dims) <= {found[1]}:
        return None
    r, p, s, position, inside = found
    column = ctx.sequence_starts() + position
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    at = jnp.expand_dims(column, tuple(range(2, xs.ndim)))
    picked = jnp.take_along_axis(xs, at, axis=1, mode="clip")      # (rows, columns, *rest)
    fill = jnp.asarray(gather_fill(eqn.params, x.dtype), x.dtype)
    picked = jnp.where(jnp.expand_dims(inside, tuple(range(2, xs.ndim))), picked, fill)
    rest = [a for a in range(len(shape)) if a not in (r, p)]
    if p not in dn.collapsed_slice_dims:            # the position's unit axis stays
        kept = sorted([*rest, p])
        picked = jnp.expand_dims(picked, 2 + kept.index(p))
    out = eqn.outvars[0].aval.shape
    batch = [d for d in range(len(out)) if d not in dn.offset_dims]   # the index's axes
    r_out = batch[s]
    held_at = lambda d: d + (d > r_out)  # noqa: E731 - the columns follow the rows
    others = [d for d in batch if d != r_out]
    picked = jnp.reshape(picked, (*picked.shape, *(1,) * len(others)))
    dest = [r_out, r_out + 1, *map(held_at, dn.offset_dims), *map(held_at, others)]
    return [PerSequence(jnp.moveaxis(picked, tuple(range(len(dest))), dest), r_out)]


def _put_own(ctx: _PackedCtx, eqn, invals):
    """The transpose of `_pick_own`: each sequence's update added into (or set at) its own
    position; nothing where that is outside the sequence."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    update_shape = eqn.invars[2].aval.shape
    if isinstance(x, PerSequence) or eqn.primitive.name not in ("scatter-add", "scatter"):
        return None
    window = _scatter_window(eqn)
    found = _own_position(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
                          (dn.operand_batching_dims, dn.scatter_indices_batching_dims),
                          eqn.invars[1].aval.shape)
    if found is None or not set(dn.inserted_window_dims) <= {found[1]}:
        return None
    r, p, s, position, inside = found
    scattered = [d for d in range(len(update_shape)) if d not in dn.update_window_dims]
    r_upd = scattered[s]
    if isinstance(updates, PerSequence) and updates.axis != r_upd:
        return None
    updates = held(ctx, updates, update_shape)
    u = jnp.moveaxis(updates.value, (r_upd, r_upd + 1), (0, 1))
    # Then the update's other axes in order: the index's unit axes and the window's.
    rest_u = [d for d in range(len(update_shape)) if d != r_upd]
    unit = [2 + i for i, d in enumerate(rest_u) if d not in dn.update_window_dims]
    if p not in dn.inserted_window_dims:            # the position's unit axis: squeezed
        kept = [a for a in range(len(shape)) if a not in (r,) and a not in dn.inserted_window_dims]
        unit.append(2 + len([d for d in rest_u if d not in dn.update_window_dims])
                    + kept.index(p))
    u = lax.squeeze(u, tuple(unit))                 # (rows, columns, *operand's other axes)
    n = shape[p]
    u = lax.slice_in_dim(u, 0, n, axis=1)
    rest = [a for a in range(len(shape)) if a not in (r, p)]
    cells = spread(u, shape, (r, p, *rest))
    return _write_at_positions(ctx, eqn, x, cells, position, inside, r, p)


def _put_ranked(ctx: _PackedCtx, eqn, invals):
    """``top_k``'s gradient: the scatter-add of each sequence's ``k`` updates at its ``k``
    positions (`_top_per_sequence` holds both at every cell of the sequence), into a
    ``(rows, packed length)`` operand: rank by rank, as one position per sequence is written
    back (`_write_at_positions`), so nothing crosses a sequence or lands outside the frame."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    index_shape = eqn.invars[1].aval.shape
    if (eqn.primitive.name != "scatter-add" or isinstance(x, PerSequence)
            or not isinstance(index, PerSequence) or index.axis != 0 or len(shape) != 2
            or ctx.row_axes(shape) != [0] or ctx.packed_axes(shape) != [1]
            or (tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims),
                tuple(dn.scatter_dims_to_operand_dims), tuple(dn.inserted_window_dims),
                tuple(dn.update_window_dims)) != ((0,), (0,), (1,), (1,), ())
            or len(index_shape) != 3 or is_sym(index_shape[1]) or index_shape[2] != 1):
        return None
    value = held(ctx, updates, eqn.invars[2].aval.shape).value      # (rows, columns, k)
    for j in range(index_shape[1]):             # each rank's update, as one position's
        cells = lax.slice_in_dim(value[:, :, j], 0, shape[1], axis=1)
        (x,) = _write_at_positions(ctx, eqn, x, cells, index.value[:, :, j, 0], ctx.pos >= 0,
                                   0, 1)
    return [x]


def _write_at_positions(ctx: _PackedCtx, eqn, x, cells, position, inside, r: int, p: int):
    """``x`` with each sequence's cell at ``position`` (per cell, where ``inside``) set to
    ``cells`` there (``scatter``) or added to (``scatter-add``): the write-back of a packed
    per-sequence index, the transpose of reading one."""
    shape = eqn.invars[0].aval.shape
    n = shape[p]
    pos, _ = ctx.cells(n)
    at = (pos == lax.slice_in_dim(position, 0, n, axis=1)) & lax.slice_in_dim(inside, 0, n, axis=1)
    at = spread(at & ctx.in_frame(n), shape, (r, p))
    if eqn.primitive.name == "scatter":
        return [lax.select(at, cells, x)]
    return [x + lax.select(at, cells, filled(shape, 0, x.dtype))]


def _pick(ctx: _PackedCtx, eqn, invals):
    """``x[:, k]`` and ``x[:, -1]`` of a packed value (and ``r[k]`` under ``jax.vmap``): each
    sequence's own position ``k`` (``n - 1``), a per-sequence value; outside the sequence, as
    the gather's mode says."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if isinstance(x, PerSequence) else _position(
        ctx, eqn, shape, index, dn.start_index_map, eqn.params["slice_sizes"])
    if found is None:
        return None
    p, position, inside = found
    kept = len(shape) - len(dn.collapsed_slice_dims)
    if (not set(dn.collapsed_slice_dims) <= {p} or dn.operand_batching_dims
            or tuple(dn.offset_dims) != tuple(range(kept))):
        return None
    (r,) = ctx.row_axes(shape)
    n = ctx._at(shape[p], ctx.seglen)
    column = ctx.sequence_starts() + jnp.clip(position, 0, jnp.maximum(n - 1, 0))
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    picked = jnp.take_along_axis(xs, jnp.expand_dims(column, tuple(range(2, xs.ndim))), axis=1,
                                 mode="clip")
    # Outside the sequence the gather's fill (a sequence of length 0 has no position to clamp
    # to, whatever the mode).
    outside = ~inside if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP else n <= 0
    keep = jnp.expand_dims(~outside, tuple(range(2, xs.ndim)))
    picked = jnp.where(keep, picked, jnp.asarray(gather_fill(eqn.params, x.dtype), x.dtype))
    if p not in dn.collapsed_slice_dims:            # the position's unit axis stays
        picked = jnp.expand_dims(picked, 2 + p - (r < p))
    (r_out,) = ctx.row_axes(eqn.outvars[0].aval.shape)
    return [by_cell(picked, r_out)]


def _put(ctx: _PackedCtx, eqn, invals):
    """The transpose of `_pick` (``x.at[:, -1].add(g)``, ``.set``): each sequence's update
    into its own position ``k`` (``n - 1``); nothing where that is outside the sequence."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    update_shape = eqn.invars[2].aval.shape
    kept = len(shape) - len(dn.inserted_window_dims)
    if (isinstance(x, PerSequence) or eqn.primitive.name not in ("scatter-add", "scatter")
            or dn.operand_batching_dims or tuple(dn.update_window_dims) != tuple(range(kept))):
        return None
    window = list(update_shape)
    for a in sorted(dn.inserted_window_dims):
        window.insert(a, 1)
    found = _position(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window)
    if found is None or not set(dn.inserted_window_dims) <= {found[0]}:
        return None
    p, position, inside = found
    if isinstance(updates, PerSequence) and updates.axis is None or not ctx.row_axes(update_shape):
        raise NoRule("a scatter into one position of a packed length from a value without rows")
    updates = held(ctx, updates, update_shape)
    (r,) = ctx.row_axes(shape)
    value = updates.value
    if p not in dn.inserted_window_dims:            # the position's unit axis: squeezed
        value = lax.squeeze(value, (p + (p > r),))
    n = shape[p]
    # The update's axes in the operand's, the columns taking the place of the packed axis.
    targets = [a for a in range(len(shape)) if a != p]
    targets.insert(targets.index(r) + 1, p)
    cells = spread(lax.slice_in_dim(value, 0, n, axis=targets.index(p)), shape, targets)
    return _write_at_positions(ctx, eqn, x, cells, position, inside, r, p)


def _sequence_and_position(ctx: _PackedCtx, eqn, shape, index, index_map, window, batching,
                           index_shape):
    """Where ``h[jnp.arange(B), lengths - 1]`` (``h[rows, positions]``) reads, or its
    transpose writes: an equation whose index, one pair per sequence (a per-sequence value of
    shape ``(B, 2)``), picks a row of the logical batch -- a sequence -- and a position of
    the packed axis, and every entry of the other axes. As in the pad layout, the row is
    clamped into the real sequences and the position into that sequence's own part of the
    axis (the gather's fill, or a dropped update, outside them in FILL_OR_DROP mode, and in a
    sequence of length 0, which has no cell). ``(r, p, row, column, inside)``: the operand's
    rows and packed axes, and per grid cell (its sequence's pair) the packed row and column
    read, and whether they hold that position; None for any other indexing."""
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    if (len(rows) != 1 or len(packed) != 1 or any(tuple(b) for b in batching)
            or not isinstance(index, PerSequence) or index.axis != 0
            or len(index_shape) != 2 or set(index_map) != {rows[0], packed[0]}):
        return None
    (r,), (p,) = rows, packed
    if any(window[a] != 1 if a in (r, p) else not _core_equal(window[a], shape[a])
           for a in range(len(shape))):
        return None
    sequence = index.value[..., list(index_map).index(r)].astype(np.int32)   # (rows, columns)
    position = index.value[..., list(index_map).index(p)].astype(np.int32)
    count = jnp.asarray(ctx.sizes[ctx.rows_name], np.int32)    # the sequences of the call
    inside = (sequence >= 0) & (sequence < count)
    sequence = jnp.clip(sequence, 0, count - 1)
    row, start, length = (jnp.take(t, sequence, mode="clip") for t in _sequence_table(ctx))
    n = ctx._at(shape[p], length)
    if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        inside = inside & (position >= 0) & (position < n)
    else:
        position, inside = jnp.clip(position, 0, jnp.maximum(n - 1, 0)), n > 0
    return r, p, row, start + position, inside


def _sequence_table(ctx: _PackedCtx):
    """Per sequence of the call (by its index; as many entries as cells, which hold every
    sequence): the packed row it is in, the column it starts at and its length, read at its
    first cell (a sequence of length 0 holds one, with ``pos`` 0)."""
    sequence = ctx.sequence_index(ctx.pos.shape[1])
    first = (ctx.pos == 0) & (sequence >= 0)
    size = sequence.size
    at = jnp.where(first, sequence, size).reshape(-1)       # past the end: dropped
    row = lax.broadcasted_iota(np.int32, sequence.shape, 0)
    column = lax.broadcasted_iota(np.int32, sequence.shape, 1)
    return tuple(jnp.zeros(size, np.int32).at[at].set(v.reshape(-1), mode="drop")
                 for v in (row, column, ctx.seglen))


def _pick_sequences(ctx: _PackedCtx, eqn, invals):
    """``h[jnp.arange(B), lengths - 1]`` of a packed value: each sequence's entry of the row
    and position its index names (`_sequence_and_position`), a per-sequence value."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if isinstance(x, PerSequence) else _sequence_and_position(
        ctx, eqn, shape, index, dn.start_index_map, eqn.params["slice_sizes"],
        (dn.operand_batching_dims, dn.start_indices_batching_dims), eqn.invars[1].aval.shape)
    if found is None or set(dn.collapsed_slice_dims) != {found[0], found[1]}:
        return None
    r, p, row, column, inside = found
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    picked = xs[row, jnp.clip(column, 0, xs.shape[1] - 1)]     # (rows, columns, *rest)
    fill = jnp.asarray(gather_fill(eqn.params, x.dtype), x.dtype)
    picked = jnp.where(jnp.expand_dims(inside, tuple(range(2, xs.ndim))), picked, fill)
    out = eqn.outvars[0].aval.shape
    (r_out,) = [d for d in range(len(out)) if d not in dn.offset_dims]
    return [by_cell(picked, r_out)]


def _put_sequences(ctx: _PackedCtx, eqn, invals):
    """The transpose of `_pick_sequences`: each sequence's update, once (from its first
    cell), added into (or set at) the row and position its index names; nothing where that
    is outside the sequence it names."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    if (isinstance(x, PerSequence) or eqn.primitive.name not in ("scatter-add", "scatter")
            or dn.operand_batching_dims or not isinstance(index, PerSequence)
            or len(dn.update_window_dims) + len(dn.inserted_window_dims) != len(shape)):
        return None
    update_shape = eqn.invars[2].aval.shape
    window = _scatter_window(eqn)
    found = _sequence_and_position(
        ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
        (dn.operand_batching_dims, dn.scatter_indices_batching_dims), eqn.invars[1].aval.shape)
    if found is None or set(dn.inserted_window_dims) != {found[0], found[1]}:
        return None
    r, p, row, column, inside = found
    (r_upd,) = [d for d in range(len(update_shape)) if d not in dn.update_window_dims]
    if isinstance(updates, PerSequence) and updates.axis != r_upd:
        return None
    u = jnp.moveaxis(held(ctx, updates, update_shape).value, (r_upd, r_upd + 1), (0, 1))
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    # Every cell holds its sequence's update: written from the first cell only, and nowhere
    # (a row past the end, dropped) where the named position is outside its sequence.
    write = inside & (ctx.pos == 0)
    row = jnp.where(write, row, xs.shape[0])
    if eqn.primitive.name == "scatter":
        written = xs.at[row, column].set(u, mode="drop")
    else:
        written = xs.at[row, column].add(u, mode="drop")
    return [jnp.moveaxis(written, (0, 1), (r, p))]


def _cell_positions(ctx: _PackedCtx, eqn, shape, index, index_map, window, batching,
                    index_shape):
    """Where a gather with one index per cell reads (its transpose writes) along the packed
    axis of ``shape``: an index with the rows axis and a packed length among its own axes
    (a packed value, as ``jnp.argsort(x, axis=1)`` is) whose position component counts
    inside a sequence. Either batched over the rows (``take_along_axis(x, jnp.argsort(x,
    axis=1), 1)``; a sort's JVP and its transpose, the gradients of ``jnp.sort`` and
    ``jnp.median``), where each cell indexes its own sequence, or with a component that names
    the row (``x[jnp.arange(B)[:, None], idx]``), where each cell indexes the sequence it
    names, wherever it is packed (`_sequence_table`), as `_sequence_and_position` does for
    one index per sequence. Per entry of the index, as at each sequence's exact length: CLIP
    and PROMISE_IN_BOUNDS clamp the position into the sequence's own ``[0, n - 1]``; outside
    it FILL_OR_DROP fills (drops); a sequence of length 0 has no cell to read in any mode.

    ``(components, read, real)``: the index's components in its dtype (the packed row and
    the column for the row and packed ones, every component in bounds), whether each entry
    reads a position of its sequence (else the gather's fill, a dropped update), and whether
    the entry belongs to a cell in the frame of the index's packed length (the others are
    "don't care", and must never write); None for any other indexing."""
    if (isinstance(index, (PerSequence, PerCell, NotPacked)) or not hasattr(index, "shape")
            or len(index_shape) < 2):
        return None
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    cells = tuple(index_shape[:-1])
    index_rows, index_packed = ctx.row_axes(cells), ctx.packed_axes(cells)
    if len(rows) != 1 or len(packed) != 1 or len(index_rows) != 1 or len(index_packed) != 1:
        return None
    (r,), (p,), (s,), (q,) = rows, packed, index_rows, index_packed
    # Any other axis of the index repeats a cell's index (a fixed number of them).
    if any(is_sym(d) for a, d in enumerate(cells) if a not in (s, q)):
        return None
    operand_batching, index_batching = (tuple(b) for b in batching)
    if operand_batching:               # batched over the rows: each cell's own sequence
        if (r not in operand_batching or p in operand_batching or r in index_map
                or index_batching[operand_batching.index(r)] != s or p not in index_map):
            return None
    elif not {r, p} <= set(index_map):
        return None
    # Other components index axes that are no length (``jnp.put_along_axis`` names every
    # axis), as the equation says; every other axis is taken whole.
    if (any(is_sym(window[a]) or window[a] != 1 for a in (r, p) if a not in operand_batching)
            or any(is_sym(shape[a]) for a in index_map if a not in (r, p))
            or any(not _core_equal(window[a], shape[a]) for a in range(len(shape))
                   if a not in (r, p, *index_map, *operand_batching))):
        return None
    m = cells[q]
    grid = lambda v: spread(v, cells, (s, q))          # noqa: E731 - (rows, m) onto the index
    real = grid(ctx.in_frame(m))
    idx = jnp.asarray(index)
    component = lambda a: idx[..., list(index_map).index(a)]  # noqa: E731
    if operand_batching:
        _, seglen = ctx.cells(m)
        start, n = grid(ctx.starts(m, 0)), grid(ctx._at(shape[p], seglen))
        named = None
    else:
        sequence = _as_int32(component(r))
        count = jnp.asarray(ctx.sizes[ctx.rows_name], np.int32)    # the sequences of the call
        named = (sequence >= 0) & (sequence < count)
        row, start, length = (jnp.take(t, jnp.clip(sequence, 0, count - 1), mode="clip")
                              for t in _sequence_table(ctx))
        n = ctx._at(shape[p], length)
    position = _as_int32(component(p))
    if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        read = (position >= 0) & (position < n)
        read = read if named is None else read & named
    else:
        position, read = jnp.clip(position, 0, jnp.maximum(n - 1, 0)), n > 0
    column = jnp.clip(start + position, 0, shape[p] - 1)
    comps = {p: column} if named is None else {p: column, r: row}
    components = jnp.stack([comps[a].astype(idx.dtype) if a in comps else idx[..., i]
                            for i, a in enumerate(index_map)], axis=-1)
    return components, read, real


def _clamped_others(components, index_map, shape, window, mode, skip):
    """``components`` with those of the axes not in ``skip`` clamped into their bounds in
    CLIP and PROMISE_IN_BOUNDS mode, so that a scatter bound in FILL_OR_DROP mode (to drop
    chosen entries) keeps the equation's own mode for them."""
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        return components
    for i, a in enumerate(index_map):
        if a not in skip:
            components = components.at[..., i].set(
                jnp.clip(components[..., i], 0, shape[a] - window[a]).astype(components.dtype))
    return components


def _as_int32(v):
    """An index component as int32, an unsigned one (a sort's permutation) saturating rather
    than wrapping to a negative position."""
    if jnp.issubdtype(v.dtype, jnp.unsignedinteger):
        v = jnp.minimum(v, np.iinfo(np.int32).max)
    return v.astype(np.int32)


def _pick_cells(ctx: _PackedCtx, eqn, invals):
    """A gather with one index per cell (`_cell_positions`): each entry reads its sequence's
    position, at the column where the sequence starts plus that position; the gather's fill
    where the position is outside the sequence."""
    x, index = invals
    dn = eqn.params["dimension_numbers"]
    found = None if isinstance(x, PerSequence) else _cell_positions(
        ctx, eqn, eqn.invars[0].aval.shape, index, dn.start_index_map,
        eqn.params["slice_sizes"], (dn.operand_batching_dims, dn.start_indices_batching_dims),
        eqn.invars[1].aval.shape)
    if found is None:
        return None
    components, read, _ = found
    # The row and column components are in bounds: the equation's mode acts on the others.
    (out,) = bind_eqn_with(eqn, [x, components])
    cells = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
    keep = lax.broadcast_in_dim(read, out.shape, cells)
    return [lax.select(keep, out, filled(out.shape, gather_fill(eqn.params, out.dtype),
                                         out.dtype))]


def _put_cells(ctx: _PackedCtx, eqn, invals):
    """The transpose of `_pick_cells` (and ``x.at[b, idx].add(u)``, ``.set``): each cell's
    update into its sequence's position; nothing from an entry whose position is outside its
    sequence (FILL_OR_DROP) or whose cell holds no position (outside the frame)."""
    x, index, updates = invals
    dn = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    if (isinstance(x, PerSequence) or eqn.primitive.name not in ("scatter-add", "scatter")
            or isinstance(updates, (PerSequence, PerCell, NotPacked)) or ctx.alive is not None):
        # Inside a packed scan a row's update may come from a cell that is not real there.
        return None
    window = _scatter_window(eqn)
    found = _cell_positions(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
                            (dn.operand_batching_dims, dn.scatter_indices_batching_dims),
                            eqn.invars[1].aval.shape)
    if found is None:
        return None
    components, read, real = found
    (r,), (p,) = ctx.row_axes(shape), ctx.packed_axes(shape)
    components = _clamped_others(components, dn.scatter_dims_to_operand_dims, shape, window,
                                 eqn.params["mode"], (r, p))
    # Dropped: sent past the end of the packed axis, which FILL_OR_DROP skips.
    past = list(dn.scatter_dims_to_operand_dims).index(p)
    beyond = jnp.asarray(x.shape[p], components.dtype)
    components = components.at[..., past].set(jnp.where(read & real, components[..., past],
                                                        beyond))
    return bind_eqn_with(eqn, [x, components, updates], mode=lax.GatherScatterMode.FILL_OR_DROP)


def _pick_any(ctx: _PackedCtx, eqn, invals):
    """One position of each sequence: ``x[:, k]`` (`_pick`), batched over the rows with a
    per-sequence index (`_pick_own`), or a row and a position named per sequence
    (`_pick_sequences`); or one position per cell (`_pick_cells`); None for any other
    gather."""
    for pick in (_pick, _pick_own, _pick_sequences, _pick_cells):
        picked = pick(ctx, eqn, invals)
        if picked is not None:
            return picked
    return None


def _put_any(ctx: _PackedCtx, eqn, invals):
    """The transposes of `_pick_any`."""
    for put in (_put, _put_own, _put_ranked, _put_sequences, _put_cells):
        done = put(ctx, eqn, invals)
        if done is not None:
            return done
    return None


@defrule("gather", layout="pack")
def _gather(ctx: _PackedCtx, eqn, invals):
    picked = _pick_any(ctx, eqn, invals)
    return picked if picked is not None else _generic(ctx, eqn, invals)


@defrule("scatter-add", "scatter", layout="pack")
def _scatter(ctx: _PackedCtx, eqn, invals):
    put = _put_any(ctx, eqn, invals)
    return put if put is not None else _generic(ctx, eqn, invals)


defrule("gather", layout="per_sequence")(_pick_any)
defrule("scatter-add", "scatter", layout="per_sequence")(_put_any)


# --------------------------------------------------------------------------------------------
# Per-cell values without rows (`PerCell`)

def _per_cell(ctx: _PackedCtx, eqn, invals):
    """An equation reading a `PerCell` value (or making one: `_PackedCtx.without_rows`):
    a call runs its equations; a primitive with a per-cell rule (``defrule(...,
    layout="per_cell")``: a broadcast, a reverse, an index) runs it; elementwise maths stays
    per cell; anything else is refused."""
    name = eqn.primitive.name
    entry = lookup_rule(eqn.primitive)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    if entry is not None and getattr(entry.rule, "inline", False):
        return entry.rule(ctx, eqn, invals)       # a call: its equations meet the value
    if entry is not None and entry.per_cell is not None:
        out_values = entry.per_cell(ctx, eqn, invals)
        if out_values is not None:
            return out_values
    if entry is not None and entry.rule is ELEMENTWISE:
        rows = ctx.row_axes(out)
        if not rows:
            cells = [_cells(ctx, x, sh, out) for x, sh in zip(invals, shapes)]
            return [PerCell(bind_eqn(eqn, cells)[0])]
        # jnp's implicit broadcast: a (1, T) operand beside (B, T) ones -- onto the rows.
        (r,) = rows
        return ctx.evaluate(eqn, [_onto_rows(x, r) if isinstance(x, PerCell) else x
                                  for x in invals])
    raise NoRule(f"{name} of a value that differs per sequence and per position (it has no "
                  f"rows axis)")


@defrule("broadcast_in_dim", layout="per_cell")
def _broadcast_cells(ctx: _PackedCtx, eqn, invals):
    """Broadcasting a per-cell value onto the rows gives each cell its own entry."""
    x = invals[0]
    if not isinstance(x, PerCell):
        return None
    out = tuple(eqn.outvars[0].aval.shape)
    dims = tuple(eqn.params["broadcast_dimensions"])
    rows = ctx.row_axes(out)
    if not rows:
        return [PerCell(lax.broadcast_in_dim(x.value, (ctx.pos.shape[0], *out),
                                             (0, *(d + 1 for d in dims))))]
    (r,) = rows
    v = x.value
    if r in dims:                   # a unit axis onto the rows: the rows are in front
        v, dims = lax.squeeze(v, (1 + dims.index(r),)), tuple(d for d in dims if d != r)
    return [spread(v, out, (r, *dims))]


@defrule("rev", layout="per_cell")
def _reverse_cells(ctx: _PackedCtx, eqn, invals):
    """A reverse of a per-cell value along the packed length is per sequence."""
    x = invals[0]
    if not isinstance(x, PerCell):
        return None
    shape = tuple(eqn.invars[0].aval.shape)
    dims = tuple(eqn.params["dimensions"])
    packed = [d for d in dims if d in ctx.packed_axes(shape)]
    if len(packed) != 1 or len(ctx.packed_axes(shape)) != 1:
        raise NoRule("a reverse of a per-cell value along no, or more than one, length")
    return [PerCell(_reverse(ctx, x.value, 0, packed[0] + 1,
                             tuple(d + 1 for d in dims if d != packed[0])))]


@defrule("gather", "scatter-add", layout="per_cell")
def _index_cells(ctx: _PackedCtx, eqn, invals):
    """``x[:, index]`` with a per-cell index reads each sequence's own positions
    (`_gather_at_positions`, and its transpose)."""
    if not isinstance(invals[1], PerCell) or any(
            isinstance(v, PerCell) for k, v in enumerate(invals) if k != 1):
        return None
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    return _gather_at_positions(ctx, eqn, invals, shapes, tuple(eqn.outvars[0].aval.shape))


def _cells(ctx: _PackedCtx, x, shape, out):
    """An operand of an elementwise `PerCell` equation of logical ``out``, with the rows in
    front: a per-sequence number at each cell, a per-position value placed by position."""
    if isinstance(x, PerCell):
        return x.value
    packed = ctx.packed_axes(out)
    rows = ctx.pos.shape[0]
    if isinstance(x, PerSequence):
        if x.axis is not None or shape != () or len(packed) != 1:
            raise NoRule(f"a per-sequence value meets a value of shape {out}")
        v = lax.slice_in_dim(x.value, 0, out[packed[0]], axis=1)
        return spread(v, (rows, *out), (0, 1 + packed[0]))
    if shape == ():
        return x
    if (not ctx.row_axes(shape) and len(shape) == len(out)
            and all(not is_sym(d) and d == 1 for d in shape)):
        # jnp's broadcast of a unit axis (linspace's start, ``(1,)``, times ``T - 1``
        # positions): the same at every cell.
        return jnp.broadcast_to(jnp.reshape(x, (1, *shape)), (rows, *out))
    if ctx.row_axes(shape) or not _core_equal_shapes(shape, out):
        raise NoRule(f"a per-cell value meets a value of shape {shape}")
    return _by_position(ctx, x, tuple(range(1, len(out) + 1)), (rows, *out), 0,
                        [1 + p for p in packed])


def _core_equal_shapes(a, b) -> bool:
    return len(a) == len(b) and all(_core_equal(x, y) for x, y in zip(a, b))


def _onto_rows(x: PerCell, r: int):
    """A `PerCell` value whose logical axis ``r`` is a unit one, as a packed value with its
    rows there."""
    return jnp.moveaxis(lax.squeeze(x.value, (1 + r,)), 0, r)


def _gather_at_positions(ctx: _PackedCtx, eqn, invals, shapes, out):
    """``x[:, index]`` along a packed length with a `PerCell` index (``x[:, ::-1]`` indexes
    with ``T - 1 - iota``, reversed): each cell reads its own sequence's position
    ``index``, at column ``start + index``; and the transpose, a scatter-add of each cell's
    update into that column. An index outside the sequence is clamped, or dropped and filled,
    as the equation's mode says."""
    x, index = invals[:2]
    shape = shapes[0]
    dn = eqn.params["dimension_numbers"]
    gather = eqn.primitive.name == "gather"
    index_map = dn.start_index_map if gather else dn.scatter_dims_to_operand_dims
    collapsed = dn.collapsed_slice_dims if gather else dn.inserted_window_dims
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    where = shapes[1][:-1]             # the index's own axes: one packed length
    if not (len(rows) == 1 and len(packed) == 1 and tuple(index_map) == tuple(packed)
            and tuple(collapsed) == tuple(packed) and not dn.operand_batching_dims
            and shapes[1][-1] == 1 and len(where) == 1 and ctx.packed_axes(where)):
        raise NoRule(f"{eqn.primitive.name} with a per-cell index of another form than "
                      f"x[:, index]")
    (r,), (p,) = rows, packed
    window = (dn.offset_dims if gather else dn.update_window_dims)
    kept = [d for d in range(len(shape)) if d != p]
    if tuple(window) != tuple(d if d < p else d + 1 for d in range(len(kept))) or (
            gather and any(not _core_equal(eqn.params["slice_sizes"][d], shape[d]) for d in kept)):
        raise NoRule(f"{eqn.primitive.name} with a per-cell index that does not keep every "
                      f"other axis in place")
    m = where[0]                       # the cells read (written): the index's length
    position = lax.slice_in_dim(index.value[..., 0], 0, m, axis=1).astype(np.int32)
    pos, seglen = ctx.cells(m)
    n = ctx._at(shape[p], seglen)
    inside = (position >= 0) & (position < n)
    if eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        position, inside = jnp.clip(position, 0, jnp.maximum(n - 1, 0)), n > 0
    column = jnp.where(inside & ctx.in_frame(m), ctx.starts(m, 0) + position, -1)
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    at = jnp.expand_dims(column, tuple(range(2, xs.ndim)))
    if gather:
        got = jnp.take_along_axis(xs, jnp.maximum(at, 0), axis=1, mode="clip")
        fill = jnp.asarray(gather_fill(eqn.params, x.dtype), x.dtype)
        return [jnp.moveaxis(jnp.where(at >= 0, got, fill), (0, 1), (r, p))]
    updates = jnp.moveaxis(invals[2], (r, p), (0, 1))
    row = lax.broadcasted_iota(np.int32, column.shape, 0)
    into = jnp.where(column >= 0, column, xs.shape[1])                # past the end: dropped
    return [jnp.moveaxis(xs.at[row, into].add(updates, mode="drop"), (0, 1), (r, p))]


@defrule("broadcast_in_dim", layout="pack")
def _broadcast_in_dim(ctx: _PackedCtx, eqn, invals):
    (x,) = invals[:1]
    shape, dims = eqn.params["shape"], tuple(eqn.params["broadcast_dimensions"])
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    if len(rows) != 1 or len(packed) not in (1, 2):
        return None
    positions = ctx.known(x).positions
    if rows[0] in dims:
        k_rows = dims.index(rows[0])
        if is_sym(x.shape[k_rows]):
            return None                # the rows kept: per position
        # A unit axis broadcast onto the rows ((T,) -> (1, T) -> (B, T), jnp's implicit
        # broadcasting): a per-position value all the same, so drop it and place as below.
        x = lax.squeeze(x, (k_rows,))
        dims = dims[:k_rows] + dims[k_rows + 1:]
        if positions is not None:
            positions = _unit_axis_at(positions, k_rows)
    along = [t for t in packed if t in dims and is_sym(x.shape[dims.index(t)])]
    if not along:
        return None                    # a per-row broadcast, constant along the packed lengths
    if positions is not None:
        return [_at_positions(ctx, positions, x, dims, shape, rows[0], along)]
    return [_by_position(ctx, x, dims, shape, rows[0], along)]


# Integer and boolean maths, as cheap to recompute per cell as a gather would be to read: a
# value made from positions with them (a causal mask, ``pos[:, None] >= pos[None, :]``)
# becomes one compare per cell of the scores, fused into their select as hand-written
# segment ids are; gathered, its placement cost the packed attention step two gathers over
# ``(B, H, T, T)``. Transcendental maths (a sinusoidal table) stays gathered.
_RECOMPUTED = frozenset("""
    convert_element_type eq ne lt le gt ge and or not xor add sub mul neg max min select_n
    abs sign
""".split())


def _positions_recipe(eqn, reading) -> Callable | None:
    """``Known.positions`` of ``eqn``'s output from its inputs' (``reading``: value and
    annotation each): an ``iota``, or `_RECOMPUTED` maths, a broadcast or a transpose of
    values made from positions and scalars."""
    name, params = eqn.primitive.name, eqn.params
    if name == "iota":
        dim, dtype = params["dimension"], params["dtype"]
        return lambda index: index[dim].astype(dtype)
    inputs = []
    for x, known in reading:
        if known.positions is not None:
            inputs.append(known.positions)
        elif getattr(x, "shape", None) == ():      # a scalar (a held value has no shape)
            inputs.append(lambda index, x=x: x)
        else:
            return None
    if name == "broadcast_in_dim" and len(inputs) == 1:
        (inner,), src = inputs, eqn.invars[0].aval.shape
        out = params["shape"]
        dims = params["broadcast_dimensions"]
        return lambda index: inner(tuple(
            np.int32(0) if not _core_equal(src[k], out[d]) else index[d]
            for k, d in enumerate(dims)))
    if name == "transpose":
        (inner,), perm = inputs, params["permutation"]
        return lambda index: inner(tuple(index[perm.index(k)] for k in range(len(perm))))
    if name in _RECOMPUTED:
        return lambda index: eqn.primitive.bind(
            *jnp.broadcast_arrays(*(f(index) for f in inputs)), **params)
    return None


def _unit_axis_at(positions: Callable, k: int) -> Callable:
    """``positions`` of a value whose unit axis ``k`` was squeezed away."""
    return lambda index: positions((*index[:k], np.int32(0), *index[k:]))


def _at_positions(ctx: _PackedCtx, positions: Callable, x, dims, shape, rows_axis: int,
                  packed_axes):
    """What `_by_position` gathers, recomputed at each cell's positions: ``x`` is made from
    positions alone (`Known.positions`)."""
    index = []
    for k, t in enumerate(dims):
        if t in packed_axes:
            pos, _ = ctx.cells(shape[t])
            index.append(_along(jnp.maximum(pos, 0), len(shape), rows_axis, t))
        elif _core_equal(x.shape[k], 1):
            index.append(np.int32(0))
        else:
            index.append(lax.broadcasted_iota(np.int32, tuple(
                shape[a] if a == t else 1 for a in range(len(shape))), t))
    return jnp.broadcast_to(positions(tuple(index)), shape).astype(x.dtype)


def _by_position(ctx: _PackedCtx, x, dims, shape, rows_axis: int, packed_axes):
    """A per-position value (``pe[:T]``, a causal mask ``(T, T)``; no rows axis; its axes go
    to ``dims`` of ``shape``) into packed rows: each cell reads its own positions inside its
    sequence along ``packed_axes`` (one or two of them)."""
    first, *rest = packed_axes
    k = dims.index(first)
    pos, _ = ctx.cells(shape[first])
    x = jnp.take(x, jnp.clip(pos, 0, ctx.physical(x.shape[k]) - 1), axis=k, mode="clip")
    targets = [*dims[:k], rows_axis, first, *dims[k + 1:]]
    for t in rest:                     # the second axis: by the position in the same row
        a, b = targets.index(t), targets.index(rows_axis)
        pos, _ = ctx.cells(shape[t])
        index = jnp.clip(pos, 0, ctx.physical(x.shape[a]) - 1)
        index = jnp.expand_dims(index.T if a < b else index,
                                [i for i in range(x.ndim) if i not in (a, b)])
        x = jnp.take_along_axis(x, index, axis=a, mode="clip")
    return spread(x, shape, targets)


@defrule("iota", layout="pack")
def iota_along(ctx: _PackedCtx, eqn, invals):
    shape, dim = eqn.params["shape"], eqn.params["dimension"]
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    if len(rows) == 1 and dim == rows[0]:
        # ``jnp.arange(B)`` counts the sequences: each cell's sequence's index in the call
        # (its row in the pad layout). The packed row's own index would be another number.
        if len(packed) > 1:
            raise NoRule("iota along the rows of a value with two packed lengths")
        if not packed:
            index = ctx.sequence_index(ctx.pos.shape[1]).astype(eqn.params["dtype"])
            return [PerSequence(spread(index, grid_shape(ctx, shape, dim), (dim, dim + 1)),
                                dim)]
        (p,) = packed
        index = ctx.sequence_index(shape[p]).astype(eqn.params["dtype"])
        return [spread(index, shape, (dim, p))]
    if len(rows) != 1 or not packed:
        return None
    if dim not in packed:
        return None
    pos, _ = ctx.cells(shape[dim])
    return [spread(jnp.maximum(pos, 0).astype(eqn.params["dtype"]), shape, (rows[0], dim))]


@defrule("slice", layout="pack")
def _slice(ctx: _PackedCtx, eqn, invals):
    (x,) = invals
    rows = ctx.row_axes(x.shape)
    if not rows:
        return padded_rule(eqn)(ctx, eqn, invals)
    p = eqn.params
    strides = p["strides"] or (1,) * x.ndim
    out = eqn.outvars[0].aval.shape
    shape = tuple(eqn.invars[0].aval.shape)
    for a in range(x.ndim):
        if not is_sym(x.shape[a]):
            continue
        start, stride = p["start_indices"][a], strides[a]
        if a in rows:
            if is_sym(start) or start != 0 or stride != 1 or not _core_equal(out[a], x.shape[a]):
                raise NoRule("a slice of the rows of packed rows")
        elif (stride == 1 and not is_sym(out[a]) and len(rows) == 1
              and all(b == a or _core_equal(out[b], shape[b]) for b in range(len(shape)))):
            # x[:, k:k + m], x[:, T - 1:T] (jnp.pad's edge and reflect modes): m positions of
            # each sequence from its own k (n - 1), a per-sequence value.
            offset = (jnp.full(jnp.shape(ctx.seglen), start, np.int32) if not is_sym(start)
                      else ctx._at(start, ctx.seglen, as_value=True))
            return [_per_sequence_part(ctx, x, shape, rows[0], a, offset, int(out[a]))]
        elif is_sym(start) or stride != 1 or not is_sym(out[a]):
            # x[:, T//2:], x[:, ::2]: where each sequence's part starts or ends.
            raise NoRule("a slice of a packed length that does not keep each sequence's "
                          "start column (a per-sequence start, a stride, a constant size)")
    return None     # column q of the result reads column q + start: the same sequence


@defrule("tile", layout="pack")
def _tile(ctx: _PackedCtx, eqn, invals):
    """Tiling the feature axes copies each position's own values (RoPE's cos and sin tiled
    over both halves of the features): per position. Tiling a packed length or the rows
    would repeat a row's sequences after one another, each needing its own copies."""
    (x,) = invals
    reps = eqn.params["reps"]
    along = set(ctx.row_axes(x.shape)) | set(ctx.packed_axes(x.shape))
    if any(reps[a] != 1 for a in along):
        raise NoRule("tile along a packed length or the rows of packed rows")
    return None


@defrule("pad", layout="pack")
def _pad(ctx: _PackedCtx, eqn, invals):
    x, fill = invals
    config = eqn.params["padding_config"]
    rows, packed = ctx.row_axes(x.shape), ctx.packed_axes(x.shape)
    touched = [a for a, c in enumerate(config) if tuple(c) != (0, 0, 0)]
    if not rows or not any(a in rows or a in packed for a in touched):
        return padded_rule(eqn)(ctx, eqn, invals) if not rows else None
    if any(a in rows for a in touched) or len(packed) != 1:
        raise NoRule("pad along the rows of packed rows")
    a = packed[0]
    lo, hi, interior = config[a]
    if any(is_sym(v) for v in (lo, hi, interior)) or interior:
        raise NoRule("pad of a packed length by a length or an interior amount")
    (y,) = bind_eqn(eqn, invals)
    # Column q of the result holds column q - lo of the operand: the sequence's own values
    # for positions lo .. lo + n, the fill before and after them. A negative amount (the
    # transpose of a pad, T + 2 back to T) drops positions: position p reads p - lo.
    pos, seglen = ctx.cells(y.shape[a])
    inside = (pos >= max(lo, 0)) & (pos - lo < ctx._at(x.shape[a], seglen))
    keep = spread(inside, y.shape, (rows[0], a))
    return [lax.select(keep, y, lax.broadcast_in_dim(fill, y.shape, ()))]


@defrule("concatenate", layout="pack")
def _concatenate(ctx: _PackedCtx, eqn, invals):
    """Along a packed length, each sequence's pieces one after another from its own start
    column (``concatenate([bos, x[:, :-1]], 1)``, a shift right): position ``p`` of a
    sequence reads the piece whose per-sequence offset is the last at or before ``p``. A
    piece of a packed length holds position ``q`` at column ``start + q``; a piece of a
    constant length is per sequence (`held`: a constant is every sequence's)."""
    a = eqn.params["dimension"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    # Pieces of no entry along the axis add nothing (``jnp.pad``'s edge mode joins the rows
    # with two empty pieces).
    kept = [(x, s) for x, s in zip(invals, shapes) if is_sym(s[a]) or s[a] != 0]
    if len(kept) == 1 and len(invals) > 1:
        return [kept[0][0]]
    if a not in ctx.packed_axes(out):
        if any(is_sym(s[a]) for s in shapes):
            raise NoRule("concatenate along the rows of packed rows")
        return None     # along another axis: per position (a per-sequence value: per column)
    return [_joined_per_sequence(ctx, invals, shapes, out, a)]


def _joined_per_sequence(ctx: _PackedCtx, invals, shapes, out, a: int):
    """The pieces ``invals`` (logical ``shapes``) joined along the packed axis ``a`` of
    ``out`` (`_concatenate`)."""
    rows = ctx.row_axes(out)
    if len(rows) != 1 or len(ctx.packed_axes(out)) != 1:
        raise NoRule("concatenate along a packed length of a value without one rows axis")
    (r,) = rows
    pos, seglen = ctx.cells(out[a])
    column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
    result, offset = None, jnp.zeros_like(pos)
    for x, shape in zip(invals, shapes):
        if a in ctx.packed_axes(shape):
            # Padded to the output's length first: column ``c - offset`` is then always there.
            grow = out[a] - shape[a]
            if is_sym(grow):
                raise NoRule(f"concatenate of packed lengths {shape[a]} into {out[a]}")
            config = [(0, int(grow) if i == a else 0, 0) for i in range(len(shape))]
            piece = jnp.take_along_axis(lax.pad(x, filled((), 0, x.dtype), config),
                                        _along(column - offset, len(out), r, a), axis=a,
                                        mode="clip")
        else:
            held_x = held(ctx, x, shape).value
            held_x = lax.slice_in_dim(held_x, 0, out[a], axis=r + 1)
            index = jnp.clip(pos - offset, 0, shape[a] - 1)
            at = a + (a > r)
            index = jnp.expand_dims(index, [i for i in range(held_x.ndim) if i not in (r, r + 1)])
            taken = jnp.take_along_axis(held_x, index, axis=at, mode="clip")
            unit = tuple(1 if i == a else d for i, d in enumerate(shape))
            piece = to_cells(ctx, PerSequence(taken, r), unit, out)
        mask = _along(pos >= offset, len(out), r, a)
        result = piece if result is None else jnp.where(mask, piece, result)
        offset = offset + (ctx._at(shape[a], seglen) if is_sym(shape[a]) else shape[a])
    return result


defrule("concatenate", layout="per_sequence")(_concatenate)


@defrule("concatenate", layout="per_cell")
def _concatenate_cells(ctx: _PackedCtx, eqn, invals):
    """Per-cell pieces joined along a packed length without rows (``jnp.linspace(0, 1, T)``
    joins its ``T - 1`` per-cell points and its stop value): each sequence's pieces from its
    own first position, as `_concatenate` joins packed rows -- the per-cell values are
    packed rows with the rows in front (`_cells` places the others)."""
    a = eqn.params["dimension"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    if ctx.row_axes(out) or a not in ctx.packed_axes(out) or any(
            isinstance(x, PerSequence) for x in invals):
        raise NoRule("concatenate of a per-cell value along no packed length, or with rows")
    rows = var_dim(ctx.rows_name, out[a].scope)
    pieces = [_cells(ctx, x, s, s) for x, s in zip(invals, shapes)]
    pieces = [jnp.broadcast_to(v, (ctx.pos.shape[0], *s)) for v, s in zip(pieces, shapes)]
    return [PerCell(_joined_per_sequence(ctx, pieces, [(rows, *s) for s in shapes],
                                         (rows, *out), a + 1))]


@defrule("split", layout="pack")
def _split(ctx: _PackedCtx, eqn, invals):
    """Along a packed length (a concatenate's transpose), each sequence's parts at its own
    offsets: a part of a packed length holds position ``q`` at column ``start + q``, one of a
    constant length is per sequence (`PerSequence`, held at every cell of its sequence)."""
    (x,) = invals
    a, sizes = eqn.params["axis"], eqn.params["sizes"]
    shape = tuple(eqn.invars[0].aval.shape)
    if sum(is_sym(size) or size != 0 for size in sizes) == 1:
        # One part and empty ones (the transpose of `_concatenate`'s empty pieces): the value.
        return [x if is_sym(size) or size != 0 else filled(v.aval.shape, 0, v.aval.dtype)
                for size, v in zip(sizes, eqn.outvars)]
    if a not in ctx.packed_axes(shape):
        if is_sym(shape[a]):
            raise NoRule("split along the rows of packed rows")
        return None
    rows = ctx.row_axes(shape)
    if len(rows) != 1 or len(ctx.packed_axes(shape)) != 1:
        raise NoRule("split along a packed length of a value without one rows axis")
    (r,) = rows
    # The operand with its rows and packed axes first; parts are cut from it by cell.
    moved = jnp.moveaxis(x, (r, a), (0, 1))
    # Per cell: where its sequence's next part starts (the sizes of the parts before it).
    parts, offset = [], jnp.zeros_like(ctx.seglen)
    for size in sizes:
        if is_sym(size):
            pos, _ = ctx.cells(size)
            column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
            index = jnp.expand_dims(column + lax.slice_in_dim(offset, 0, size, axis=1),
                                    list(range(2, moved.ndim)))
            part = jnp.take_along_axis(moved, index, axis=1, mode="clip")
            parts.append(jnp.moveaxis(part, (0, 1), (r, a)))
        else:
            parts.append(_per_sequence_part(ctx, x, shape, r, a, offset, size))
        offset = offset + (ctx._at(size, ctx.seglen) if is_sym(size) else size)
    return parts


def _per_sequence_part(ctx: _PackedCtx, x, shape, r: int, a: int, offset, size: int):
    """Positions ``offset .. offset + size`` of each sequence (``offset``: per cell of the
    grid) along the packed axis ``a`` of ``x`` (logical ``shape``, rows axis ``r``): a
    `PerSequence` of ``shape`` with ``size`` along ``a`` -- a constant-size part of a split,
    ``x[:, k:k + m]``. Past the sequence's part of the axis (``x[:, 1:-1]`` of one token, or
    of an axis of ``T + 2`` past position n + 1): zeros, never the next sequence's cells."""
    moved = jnp.moveaxis(x, (r, a), (0, 1))
    at = offset[:, :, None] + lax.broadcasted_iota(np.int32, (1, 1, size), 2)
    n_rows, columns = jnp.shape(ctx.seglen)
    index = jnp.expand_dims((ctx.sequence_starts()[:, :, None] + at).reshape(
        n_rows, columns * size), list(range(2, moved.ndim)))
    taken = jnp.take_along_axis(moved, index, axis=1, mode="clip")
    taken = taken.reshape(n_rows, columns, size, *taken.shape[2:])
    inside = (at >= 0) & (at < ctx._at(shape[a], ctx.seglen)[:, :, None])
    inside = jnp.expand_dims(inside, list(range(3, taken.ndim)))
    taken = jnp.where(inside, taken, jnp.zeros((), taken.dtype))
    # Axes now (rows, columns, part, *rest); held: the logical order, columns after r.
    rest = [i for i in range(len(shape)) if i not in (r, a)]
    labels = ["r", "columns", "a", *rest]
    order = [i if i not in (r, a) else ("r" if i == r else "a") for i in range(len(shape))]
    order.insert(order.index("r") + 1, "columns")
    return PerSequence(jnp.transpose(taken, [labels.index(k) for k in order]), r)


@defrule("pad", layout="per_sequence")
def _pad_per_sequence(ctx: _PackedCtx, eqn, invals):
    """A per-sequence value padded along a constant axis into a packed length (the transpose
    of ``x[:, T - 1:T]``: ``pad(g, (T - 1, 1))``): each sequence's entries at its own
    positions ``lo(n) ..``, the fill around them -- the pieces joined per sequence as
    `_concatenate` joins them. None along any other axis (per column)."""
    x, fill = invals
    shape, out = tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)
    packed = ctx.packed_axes(out)
    config = eqn.params["padding_config"]
    along = [a for a in packed if tuple(config[a]) != (0, 0, 0)]
    if not isinstance(x, PerSequence) or isinstance(fill, PerSequence) or not along:
        return None
    (a,) = along
    lo, hi, interior = config[a]
    if (len(packed) != 1 or is_sym(shape[a]) or interior or x.axis is None
            or any(tuple(c) != (0, 0, 0) for b, c in enumerate(config) if b != a)
            or any(not is_sym(v) and v < 0 for v in (lo, hi))):
        raise NoRule("pad of a per-sequence value into a packed length with other amounts "
                     "than one run of fill before and after it")
    pieces, shapes = [], []
    for value, length in ((None, lo), (x, shape[a]), (None, hi)):
        piece_shape = tuple(length if b == a else d for b, d in enumerate(shape))
        if not is_sym(length) and length == 0:
            continue
        pieces.append(filled(piece_shape, fill, eqn.outvars[0].aval.dtype) if value is None
                      else value)
        shapes.append(piece_shape)
    return [_joined_per_sequence(ctx, pieces, shapes, out, a)]


defrule("split", layout="per_sequence")(_split)


@defrule("while", layout="pack")
def _while(ctx: _PackedCtx, eqn, invals):
    raise NoRule("a while_loop or fori_loop over packed rows: its trip count (a loop over "
                  "x.shape[1]) or its carry differs per sequence, and the sequences sharing a "
                  "packed row would need different trip counts in one loop; a scan over the "
                  "length, lax.scan(step, h, jnp.swapaxes(x, 0, 1)), packs")


defrule("while", layout="per_sequence")(_while)


@defrule("scan", layout="pack")
def _scan(ctx: _PackedCtx, eqn, invals):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    length = p["length"]
    has_rows = [bool(ctx.row_axes(v.aval.shape)) for v in eqn.invars[nc:]]
    if ctx.var not in dim_vars(length) or not any(has_rows):
        if any(isinstance(x, PerSequence) for x in invals):
            raise NoRule("a scan over another length than the packed one reads a "
                          "per-sequence value")
        return padded_rule(eqn)(ctx, eqn, invals)
    return _packed_scan(ctx, eqn, consts, init, xs)


defrule("scan", layout="per_sequence")(_scan)


def _packed_scan(ctx: _PackedCtx, eqn, consts, init, xs):
    """A scan over a packed length: every column once, up to the last real cell. At each
    sequence's first step (its last, for a reverse scan) the row's carry restarts from its
    initial value; ``alive`` marks the rows whose cell is real, so a gradient summed over the
    rows inside the body reads those only. Outside the frame the carry runs on, not frozen:
    every real cell restarts its sequence or follows a real cell of it (freezing it cost the
    GRU train step 9%). A per-sequence initial carry or constant (an encoder's state, the
    gradient of a final carry) is read at each step's column; a final carry that is read is
    each sequence's own, kept from the step that ends it."""
    p = eqn.params
    body, length, nc = p["jaxpr"], p["length"], p["num_consts"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    const_shapes, init_shapes = shapes[:nc], shapes[nc:nc + len(init)]
    if any(isinstance(v, PerSequence) and v.axis is None for v in (*consts, *init)) or any(
            isinstance(x, PerSequence) for x in xs):
        raise NoRule("a scan over a packed length reading a per-sequence number")
    if any(not ctx.row_axes(x.shape[1:]) for x in xs):
        raise NoRule("a scan over a packed length whose scanned input has no rows axis")
    if any(ctx.row_axes(s) and ctx.packed_axes(s) for s in const_shapes):
        raise NoRule("a scan over a packed length that reads a whole packed value at each step")
    carry_axes = []
    for j, shape in enumerate(init_shapes):
        axes = ctx.row_axes(shape)
        if len(axes) > 1:
            raise NoRule(f"a carry of shape {shape} has several rows axes")
        if not axes and not _accumulates(body.jaxpr, nc + j, j, ctx):
            raise NoRule(f"carry {j} of shape {shape} has no rows axis and changes by "
                          f"more than a sum over the rows (a step counter, a value the rows "
                          f"update in turn): over packed rows its steps are not any "
                          f"sequence's")
        carry_axes.append(axes[0] if axes else None)
    in_frame = ctx.in_frame(length)                       # (rows, columns)
    pos, seglen = ctx.cells(length)
    first = in_frame & ((pos == ctx._at(length, seglen) - 1) if p["reverse"] else (pos == 0))
    columns = lax.broadcasted_iota(np.int32, jnp.shape(in_frame), 1)
    stop = jnp.max(jnp.where(in_frame, columns + 1, 0), initial=0).astype(np.int32)

    def at(values):
        if not any(isinstance(v, PerSequence) for v in values):
            return None
        return lambda step: [at_column(v, step) if isinstance(v, PerSequence) else v
                             for v in values]

    starting = [at_column(c, 0) if isinstance(c, PerSequence) else c for c in init]
    keep = [a is not None and v in ctx.recorder.used for a, v in zip(carry_axes, eqn.outvars)]
    carry, ys, steps = frozen_scan(
        ctx, eqn, consts, starting, xs, carry_axes, stop,
        alive_at=_step_mask(in_frame), restart_at=_step_mask(first), freeze=False,
        consts_at=at(consts), init_at=at(init), keep=keep)
    final = []
    for c, c0, shape, a, kept in zip(carry, init, init_shapes, carry_axes, steps):
        if a is None:
            final.append(c)
        elif kept is None:          # never read: no per-sequence copy
            final.append(ctx.per_sequence(eqn, "the final carry of a scan")[0])
        else:
            final.append(_final_carry(ctx, kept, held(ctx, c0, shape), length,
                                      p["reverse"]))
    return [*final, *ys]


def _step_mask(mask):
    """A ``(rows, columns)`` bool mask as a function of the step ``at`` (a column): stored
    as ``(columns, rows)``, each step reads one contiguous row of it, where a column of the
    ``(rows, columns)`` array is a strided read -- one kernel less in the packed GRU's
    forward loop."""
    by_step = mask.T
    return lambda at: at_step(by_step, at)


def _final_carry(ctx: _PackedCtx, steps, initial: PerSequence, length, reverse: bool):
    """Each sequence's final carry: the carry after its last step (its first, reversed), read
    from the carries after every step (``steps``, stacked on a leading axis); a sequence with
    no step (length 0, or 1 over ``T - 1``) keeps its initial carry."""
    a = initial.axis
    steps = jnp.moveaxis(steps, 0, a + 1)            # each row's carry after each column
    count = ctx._at(length, ctx.seglen)              # (rows, columns): each sequence's steps
    start = ctx.sequence_starts()
    last = start if reverse else start + count - 1
    shape = list(steps.shape)
    shape[a + 1] = ctx.pos.shape[1]
    got = take_rows(ctx, steps, spread(jnp.maximum(last, 0), shape, (a, a + 1)), a + 1)
    ran = spread(count > 0, got.shape, (a, a + 1))
    return PerSequence(lax.select(ran, got, initial.value), a)


_PASS_THROUGH = {"reduce_sum", "convert_element_type", "transpose", "reshape", "squeeze", "copy", "copy_p",
                 "broadcast_in_dim", "neg", "reduce_precision"}


def _accumulates(jaxpr, invar: int, outvar: int, ctx: _PackedCtx) -> bool:
    """Whether a carry without a rows axis is left alone or grows by a sum over the rows that
    does not read it (``ct_w + x.T @ g``: a weight gradient of a scan's transpose). Then the
    order in which cells are visited does not matter, and the frozen rows add nothing."""
    out, inv = jaxpr.outvars[outvar], jaxpr.invars[invar]
    if out is inv:
        return True
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    eqn = made.get(out)
    if eqn is None or eqn.primitive.name not in ("add", "add_any"):
        return False
    carried = [v for v in eqn.invars if _is_carry(v, inv, made)]
    if len(carried) != 1:
        return False
    (other,) = [v for v in eqn.invars if v is not carried[0]] or [None]
    if other is None or _reads(other, inv, made):
        return False
    while True:
        e = made.get(other)
        if e is None:
            return False
        name = e.primitive.name
        if name == "reduce_sum" and any(a in ctx.row_axes(e.invars[0].aval.shape)
                                        for a in e.params["axes"]):
            return True
        if name == "dot_general":
            (lc, rc), _ = e.params["dimension_numbers"]
            return any(a in ctx.row_axes(e.invars[0].aval.shape) for a in lc)
        if name == "scatter-add":     # an embedding's gradient: rows added into the table
            return bool(ctx.row_axes(e.invars[2].aval.shape))
        called = _called(e)
        if called is not None:
            # Inside a call (``jax.checkpoint`` of the step: the backward scan adds the
            # weight gradient the recomputing call returns): follow the call's own output.
            made = {v: inner for inner in called.eqns for v in inner.outvars}
            other = called.outvars[e.outvars.index(other)]
            continue
        if name not in _PASS_THROUGH:
            return False
        other = e.invars[0]


def _called(eqn):
    """The program of a call-like equation (``jit``, ``remat2``, ``closed_call``...: one
    sub-program whose outputs are the equation's), None for any other."""
    entry = lookup_rule(eqn.primitive)
    programs = list(sub_jaxprs(eqn.params))
    if (entry is None or not getattr(entry.rule, "inline", False) or len(programs) != 1
            or len(programs[0].outvars) != len(eqn.outvars)):
        return None
    return programs[0]


def _is_carry(v, inv, made) -> bool:
    """Whether ``v`` is the carry ``inv`` itself, or it cast (a Python ``0.0`` initial carry
    is weakly typed: the body converts it before adding)."""
    while v is not inv:
        e = made.get(v) if not isinstance(v, jax.extend.core.Literal) else None
        if e is None or e.primitive.name not in ("convert_element_type", "copy", "copy_p"):
            return False
        v = e.invars[0]
    return True


def _reads(v, target, made) -> bool:
    seen, stack = set(), [v]
    while stack:
        u = stack.pop()
        if u is target:
            return True
        if id(u) in seen or u not in made:
            continue
        seen.add(id(u))
        stack.extend(w for w in made[u].invars if not isinstance(w, jax.extend.core.Literal))
    return False


def _core_equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - undecidable: not equal for our purposes
        return False


# --------------------------------------------------------------------------------------------


def rewrite_packed(closed_jaxpr, sizes_at, rows_at) -> Logical:
    """The packed program of a symbolic flat program whose variable ``T`` is ragged along
    ``B`` (``rows_at``): the same inputs plus ``pos`` and ``seglen`` (int32 ``(B, T)``) last,
    and after them ``sequence`` (the same) where ``reads_sequence``; run with ``B`` = packed
    rows and ``T`` = row length; ``sizes_at``'s ``B`` is the number of
    sequences and ``T`` the longest sequence's length. Outputs with a ``(B, T-like)`` pair of
    axes come back packed (the caller unpacks them per sequence).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> B, T = jax.export.symbolic_shape("B, T", constraints=["T <= 16"])
    >>> i32 = lambda *s: jax.ShapeDtypeStruct(s, np.int32)
    >>> avals = [jax.ShapeDtypeStruct((B, T), np.float32), i32(B), i32(), i32()]
    >>> program = jax.jit(lambda x, n, b, t: (jnp.sum(x[:, 1:] * x[:, :-1]),)).trace(*avals).jaxpr
    >>> packed = rewrite_packed(program, {"B": 2, "T": 3}, {"T": (1, "B")})
    >>> x = np.array([[1, 2, 3, 4, 5, 6, 0, 0]], np.float32)   # sequences [1,2,3] and [4,5,6]
    >>> pos = np.array([[0, 1, 2, 0, 1, 2, -1, -1]], np.int32)
    >>> seglen = np.array([[3, 3, 3, 3, 3, 3, 0, 0]], np.int32)
    >>> exported = jax.export.export(jax.jit(packed.fn))(*avals, i32(B, T), i32(B, T))
    >>> float(exported.call(x, np.zeros(1, np.int32), np.int32(2), np.int32(3), pos, seglen)[0])
    58.0
    """
    jaxpr = closed_jaxpr.jaxpr
    recorder = Recorder(used=_read_anywhere(jaxpr))
    if len(rows_at) != 1:
        why = ("no input gives per-sequence lengths (a `lengths_of` Spec)" if not rows_at else
               "several length variables are ragged")
        return Logical(fn=replay(closed_jaxpr), rewritten=0,
                       unsupported=(Unsupported("layout", "<inputs>", why),))
    ((var, (_, rows)),) = rows_at.items()
    dims = [d for v in jaxpr.invars for d in getattr(v.aval, "shape", ()) if is_sym(d)]
    # The layout grid: each row's T columns and the room after its last sequence.
    room = _room_needed(jaxpr, var)
    grid = jax.export.symbolic_shape(f"{rows}, {var} + {room}" if room else f"{rows}, {var}",
                                     scope=dims[0].scope)

    def held_per_cell(shape):
        """Inputs with the rows axis and no packed length (the lengths, labels): per cell."""
        r = [a for a, d in enumerate(shape) if is_sym(d) and str(d) == rows]
        packed = [d for d in shape if var in dim_vars(d)]
        return r[0] if len(r) == 1 and not packed else None

    def packed(*args):
        *flat, pos, seglen, sequence = args
        sizes = {name: flat[at] for name, at in sizes_at.items()}
        ctx = _PackedCtx(sizes, recorder, var=var, rows=rows, pos=pos, seglen=seglen,
                         sequence=sequence, room=room)
        inputs = []
        for v, x in zip(jaxpr.invars, flat):
            shape = getattr(v.aval, "shape", ())
            a = held_per_cell(shape)
            inputs.append(x if a is None else PerSequence(x, a))
        outs = eval_jaxpr(ctx, jaxpr, closed_jaxpr.consts, inputs)
        for i, (out, v) in enumerate(zip(outs, jaxpr.outvars)):
            shape = getattr(v.aval, "shape", ())
            if held_per_cell(shape) is not None:      # returned per sequence
                recorder.per_sequence = True
                outs[i] = held(ctx, out, shape).value if not isinstance(
                    out, NotPacked) else out
            if isinstance(outs[i], PerSequence) or isinstance(outs[i], NotPacked) or (
                    ctx.row_axes(shape) and len(ctx.packed_axes(shape)) != 1
                    and held_per_cell(shape) is None):
                made = (outs[i].why if isinstance(outs[i], NotPacked)
                        else "a per-sequence number" if isinstance(outs[i], PerSequence)
                        else "a per-sequence value")
                recorder.unsupported.setdefault(("output", i), Unsupported(
                    "output", f"output {i}", f"returns {made}"))
                outs[i] = filled(v.aval.shape, 0, v.aval.dtype)
        return tuple(outs)

    avals = []
    for v in jaxpr.invars:
        shape, a = tuple(v.aval.shape), held_per_cell(getattr(v.aval, "shape", ()))
        if a is not None:
            shape = (*shape[:a + 1], grid[1], *shape[a + 1:])
        avals.append(jax.ShapeDtypeStruct(shape, v.aval.dtype, weak_type=v.aval.weak_type))
    avals += [jax.ShapeDtypeStruct(tuple(grid), np.int32)] * 3
    traced = jax.jit(packed).trace(*avals).jaxpr
    fn = replay(traced)
    if not recorder.reads_sequence:
        # No rule read the sequence index: the program does not take it (one int32 array per
        # cell less to build and send each call); the traced program gets a placeholder.
        avals.pop()
        fn = functools.partial(_without_sequence, fn)
    return Logical(fn=fn, unsupported=tuple(recorder.unsupported.values()),
                   rewritten=len(recorder.rewritten), avals=tuple(avals),
                   per_sequence=recorder.per_sequence, reads_sequence=recorder.reads_sequence,
                   room=room)


def _without_sequence(fn, *args):
    """``fn`` of a packed program that never reads its last input, the sequence index."""
    return fn(*args, jnp.zeros(jnp.shape(args[-1]), np.int32))


def _read_anywhere(jaxpr) -> set:
    """The variables some equation reads or some program returns, in ``jaxpr`` and every
    program inside it: a scan's final carry that is not among them is never read."""
    read, stack = set(), [jaxpr]
    while stack:
        j = stack.pop()
        read.update(v for v in j.outvars if isinstance(v, jax.extend.core.Var))
        for eqn in j.eqns:
            read.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
            stack.extend(sub_jaxprs(eqn.params))
    return read
