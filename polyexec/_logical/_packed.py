"""Packed rows: the logical program when several sequences share each physical row.

With ``layout="pack"`` the sequences of a call (the rows of its ``(B, T)`` inputs, T ragged
along B) are laid end to end in rows of one row length (`buckets.balanced_fit`), and
the one symbolic program runs with ``B`` bound to the number of packed rows and ``T`` to the
row length. Extra inputs describe the layout, per cell of the ``(B, T)`` grid: ``pos``,
the cell's position inside its sequence (-1 in padding), ``seglen``, its sequence's length,
and, only in a program that reads it (a random draw along the rows), ``sequence``, its
sequence's index in the call's batch (-1 in padding).

Several variables
-----------------
Several ragged variables over the same rows (an encoder-decoder's source ``S`` and target
``T``) each have their own grid and layout inputs (`Grid`), an example's sequences in the
same row of every grid. An equation is rewritten in the grid its lengths name
(`PackedCtx.var`); a pair of two variables' cells (cross-attention's ``(B, T, S)`` scores)
is in the frame when both cells are of the same example; a per-sequence value moves to
another grid's cells of the same example where it meets them (`PackedCtx.moved_to`); and a
scan over one variable that reads another's cells pairs each step's cell with its
example's cells there (`PackedCtx.paired`: attention inside a decoder's scan).

The room
--------
A program with a length past ``T`` by a constant (``T + 2``: ``jnp.pad`` along T by one cell
each side; ``T + 1``: a window padded at its end) needs that many cells after each sequence:
its room, ``k`` the largest such constant (`_basics.room_of`, found by a walk of the program before
the rewrite; `Logical.rooms`). The layout leaves ``k`` cells after every sequence, the last
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
This module is the layout's machinery: `PackedCtx` and the helpers its rules share. The
rules themselves (``defrule(..., layout="pack")``, and ``"per_cell"``) live beside each
primitive's padded rule in its family module. Inside a packed row the pad layout's rules would
mix sequences, so this layout admits only:

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
labels) is held at every cell of its sequence (`_basics.Known.per_sequence`, `_sequences`;
its rules are the family modules' ``layout="per_sequence"`` ones). A per-sequence number meeting
positions without the rows axis (``jnp.arange(T) / T``, the ``T - 1 - iota`` that
``x[:, ::-1]`` indexes with) is held per cell (`_basics.Known.per_cell`): it stays per cell
through elementwise maths and reverses, and ``x[:, index]`` with it reads each sequence's own
positions. A value no rule keeps is annotated as not packed (`_basics.Known.unpackable`, with
no value), which fails the plan only if something reads it (a final carry nobody reads costs
nothing); everything else is `Unsupported` with the user's line, and ``layout="auto"`` then
runs the pad layout, where the same program is exact.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._context import equation_line
from .._jax_internals import dim_bounds, dim_vars, evaluate_dim, var_dim
from ._basics import (PLAIN, Known, bind_eqn, filled, is_sym, like_aval, lowest_value, ranked,
                      room_needed, same_dim, sub_jaxprs)
from ._core import (Ctx, Logical, Recorder, Unsupported, eval_jaxpr, moves_ragged_rows, replay,
                    take_rows)
from ._registry import ELEMENTWISE, NoRule, lookup_rule
from ._families import REDUCERS, SCATTERS
from ._cells import by_position, per_cell, positions_recipe
from ._sequences import (along_sequences, held, others_first, per_sequence, segment_of,
                         spread)
from ._sequences import evaluate as _evaluate_per_sequence


class Grid(NamedTuple):
    """One packed variable's layout inputs, ``(rows, columns)`` int32 each (see the module),
    and the room it leaves after each sequence."""

    pos: Any
    seglen: Any
    sequence: Any
    room: int = 0


class PackedCtx(Ctx):
    """The evaluation context of a packed program: each packed variable of ``grids`` (T; an
    encoder-decoder's S and T) is packed along ``rows`` (B) in its own grid, an example's
    parts in the same row of every grid. It implements `_interface.PackedLayout`, what the
    packed rules may ask; ``var`` is the variable of the equation being rewritten (`applying`).
    """

    def __init__(self, sizes, recorder, parent=None, eqn=None, alive=None, *,
                 grids: dict[str, Grid], rows: str, var: str | None, derived=None,
                 paired=None):
        super().__init__(sizes, recorder, parent, eqn, {v: (None, rows) for v in grids}, alive)
        self.grids, self.rows_name, self._var = grids, rows, var
        # Inside a scan over one packed variable (a decoder's T) that reads another's cells
        # (its encoder's (B, S, H)): per other variable, the sequence index of each row's
        # cell at this step, -1 where none is real. A value with that variable's axis then
        # pairs the step's cell with the S cells of the same example (`frame`), as the
        # (B, T, S) scores of cross-attention do.
        self.paired: dict[str, Any] = {} if paired is None else paired
        # What the rules derive from ``pos`` and ``seglen`` alone (a length's cells, its frame,
        # its sequences' start and end columns), made once per trace (`_derive`): every
        # masked contraction, reduction and zeroed tail asks again. Made at each ask, the
        # 12-layer LM's packed program had 9,296 equations (1,272 slices of ``pos``) to the
        # padded one's 4,466, and took its rewrite, export and compile time with them.
        self._derived: dict[Any, Any] = {} if derived is None else derived
        self._shapes: dict[tuple, Any] = {} if parent is None else parent._shapes  # `_of_shape`

    def child(self, eqn, *, alive=None, paired=None) -> "PackedCtx":
        if alive is not None and self.alive is not None:
            alive = lax.bitwise_and(alive, self.alive)
        # A call's equations run in this very trace (inlined): they share what it derived. A
        # loop's body or a branch is traced on its own, and derives its own (this trace's
        # values there would be constants closed over by another program).
        entry = lookup_rule(eqn.primitive) if eqn is not None else None
        return PackedCtx(self.sizes, self.recorder, self, eqn,
                          self.alive if alive is None else alive, grids=self.grids,
                          rows=self.rows_name, var=self._var,
                          derived=self._derived if entry is not None and entry.inline else None,
                          paired={**self.paired, **(paired or {})})

    def in_grid(self, var: str) -> "PackedCtx":
        """This context asking in ``var``'s grid, sharing what it derived."""
        return PackedCtx(self.sizes, self.recorder, self.parent, self.eqn, self.alive,
                          grids=self.grids, rows=self.rows_name, var=var, derived=self._derived,
                          paired=self.paired)

    @contextlib.contextmanager
    def asking_in(self, var: str):
        """While it lasts, what takes no length asks in ``var``'s grid (a scan over ``var``
        whose equation also meets another variable's cells)."""
        outer, self._var = self._var, var
        try:
            yield
        finally:
            self._var = outer

    def paired_axes(self, shape) -> list[int]:
        """The packed axes of ``shape`` of a variable paired with the enclosing scan's cell."""
        return [a for a in self.packed_axes(shape) if self.var_of(shape[a]) in self.paired]

    # -- the packed variable of the equation at hand ----------------------------------------------

    @property
    def var(self) -> str:
        """The packed variable whose grid the current equation's cells lie in: the one its
        values' lengths name (or its per-sequence operands' grid), else the enclosing one's.
        `NoRule` where an equation meets several (a rule that needs one grid cannot pick)."""
        if self._var is None:
            raise NoRule(f"an equation meets the lengths of several packed variables "
                         f"({', '.join(sorted(self.grids))}) where it needs one")
        return self._var

    pos = property(lambda self: self.grids[self.var].pos)
    seglen = property(lambda self: self.grids[self.var].seglen)
    sequence = property(lambda self: self.grids[self.var].sequence)
    room = property(lambda self: self.grids[self.var].room)

    def var_of(self, d) -> str | None:
        """The packed variable a length is an expression of (None: none); `NoRule` for one of
        several (``S + T``)."""
        names = self._of_shape("var", (d,),
                               lambda key: sorted(dim_vars(key[0]) & set(self.grids)))
        if len(names) > 1:
            raise NoRule(f"the length {d} combines several packed variables")
        return names[0] if names else None

    def _grid_of(self, d) -> Grid:
        var = self.var_of(d)
        return self.grids[var] if var is not None else self.grids[self.var]

    @contextlib.contextmanager
    def applying(self, eqn, invals):
        outer = self._var
        if len(self.grids) > 1:
            self._var = self._equation_var(eqn, outer)
        try:
            with super().applying(eqn, invals):
                yield
        finally:
            self._var = outer

    def _equation_var(self, eqn, inherited: str | None) -> str | None:
        """The one packed variable ``eqn``'s values and per-sequence operands are in, None for
        several; for none, ``inherited``, else the first: what such an equation makes with the
        rows (``jnp.arange(B)``, a ``(B, F)`` draw) is per sequence, held in one grid and moved
        to another where it meets that one's cells."""
        found = self._shape_vars(eqn) | {k.sequence_var for k in self.operands
                                         if k.per_sequence}
        if not found:
            return inherited if inherited is not None else min(self.grids)
        return found.pop() if len(found) == 1 else None

    def _shape_vars(self, eqn) -> set:
        found = set()
        for v in (*eqn.invars, *eqn.outvars):
            shape = tuple(getattr(v.aval, "shape", ()))
            for a in self.packed_axes(shape):
                found.update(n for n in dim_vars(shape[a]) if n in self.grids)
        return found

    def _derive(self, key, make):
        """``make()``, once per trace and ``key`` (see ``_derived``): it must read nothing
        but the layout inputs and the sizes, the same in every context of a trace."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    # -- axes -----------------------------------------------------------------------------------

    def row_axes(self, shape, rows: str | None = None) -> list[int]:
        return list(self._axes_of(shape)[0])

    def packed_axes(self, shape) -> list[int]:
        """Axes whose length is an expression of the packed variable (T, T - 1), not a count
        over the rows."""
        return list(self._axes_of(shape)[1])

    def _of_shape(self, what: str, shape, work: Callable[[tuple], Any]):
        """``work(shape)``, worked out once per rewrite and shape (it must read nothing but
        the shape and what is fixed for the rewrite): the rules and the interpreter ask
        about a few dozen shapes some 19,000 times in the 12-layer LM, and each answer reads
        every symbolic dimension's text or variables."""
        key = (what, tuple(shape))
        if key not in self._shapes:
            self._shapes[key] = work(key[1])
        return self._shapes[key]

    def _axes_of(self, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(rows axes, packed axes)`` of ``shape``."""
        def work(shape):
            names = [dim_vars(d) for d in shape]
            return (tuple(i for i, d in enumerate(shape)
                          if is_sym(d) and str(d) == self.rows_name),
                    tuple(i for i, n in enumerate(names)
                          if not n.isdisjoint(self.grids) and self.rows_name not in n))
        return self._of_shape("axes", shape, work)

    def rows_of(self, d) -> str | None:
        return None if dim_vars(d).isdisjoint(self.grids) else self.rows_name

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
        if names.isdisjoint(self.grids):
            if self.rows_name in names:
                if str(d) != self.rows_name:
                    raise NoRule(f"the length {d} counts packed rows")
                return self.physical(d)
            return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))
        if self.rows_name in names:
            return self._summed(d, self.rows_name)
        if shape is not None:
            if self.row_axes(shape):
                r, p = self.frame_axes(shape, "a length")
                return along(self.ends(shape[p]), len(shape), r, p)
            if shared is False or (shared is None and tuple(shape) in self.from_lengths_shapes):
                raise NoRule(f"a value of shape {tuple(shape)} reads its length {d}, which "
                              f"differs per sequence of a packed row, and has no rows axis to "
                              f"hold each sequence's result")
        elif self.current is not None and (self._has_rows(self.current, self.rows_name)
                                           or self.from_lengths_shapes):
            raise NoRule(f"{self.current.primitive.name} reads the length {d}, which differs "
                          f"per sequence of a packed row")
        # A value without rows: per position, real up to the longest sequence.
        return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))

    def _has_rows(self, eqn, rows: str) -> bool:
        return any(self.row_axes(getattr(v.aval, "shape", ()))
                   for v in (*eqn.invars, *eqn.outvars))

    def one_frame(self, shape) -> tuple[int, int] | None:
        """``(rows axis, packed axis)`` of a value of ``shape`` with exactly one of each, None
        for any other: more would mix sequences of a packed row."""
        rows, packed = self._axes_of(shape)
        return (rows[0], packed[0]) if len(rows) == 1 and len(packed) == 1 else None

    def frame_axes(self, shape, what: str, along: int | None = None) -> tuple[int, int]:
        """`one_frame` of a value of ``shape`` that ``what`` (``"a sort"``) reads: `NoRule`
        where there is none and, given ``along``, unless that axis is its packed length."""
        if along is not None and along not in self.packed_axes(shape):
            raise NoRule(f"{what} over the rows of packed rows, or over another length")
        if (frame := self.one_frame(shape)) is None:
            raise NoRule(f"{what} of a value of shape {tuple(shape)}, which mixes sequences of "
                         f"a packed row (it needs exactly one rows axis and one packed length)")
        return frame

    def cells(self, d):
        """``(pos, seglen)`` of the first ``d`` columns (an axis of packed length ``d``)."""
        grid = self._grid_of(d)
        return self._derive(("cells", d), lambda: (lax.slice_in_dim(grid.pos, 0, d, axis=1),
                                                   lax.slice_in_dim(grid.seglen, 0, d, axis=1)))

    def sequence_index(self, d):
        """``(rows, d)`` int32 of the first ``d`` columns: each cell's sequence's index in the
        call's batch (the row it has in the pad layout), -1 where no sequence is. The program
        then takes that layout input (`Logical.reads_sequence`)."""
        self.recorder.reads_sequence = True
        return lax.slice_in_dim(self._grid_of(d).sequence, 0, d, axis=1)

    def in_frame(self, d):
        """``(rows, d)`` bool: the cells inside the frame of an axis of packed length ``d``."""
        def make():
            pos, seglen = self.cells(d)
            return (pos >= 0) & (pos < self.at_lengths(d, seglen))
        return self._derive(("in_frame", d), make)

    def starts(self, d, fill: int | None = None):
        """``(rows, d)`` int32: per cell in the frame of an axis of packed length ``d``, the
        column where its sequence starts (the same in every axis: the frame); ``fill``
        elsewhere (None: the cell's own column)."""
        def make():
            pos, _ = self.cells(d)
            column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
            return jnp.where(self.in_frame(d), column - pos, column if fill is None else fill)
        return self._derive(("starts", d, fill), make)

    def sequence_starts(self):
        """``(rows, columns)`` int32: per cell of a sequence (its real cells, or the one cell a
        sequence of length 0 holds its per-sequence values at) the column where the sequence
        starts; elsewhere the cell's own column."""
        pos = self.pos

        def make():
            column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
            return jnp.where(pos >= 0, column - pos, column)
        return self._derive(("sequence_starts", self.var), make)

    def frame(self, shape):
        """bool ``shape``: the cells of a value with one rows axis and one or two packed
        lengths that hold a real position (one axis), or a pair of real positions of the same
        sequence (two axes: attention's scores)."""
        def make():
            (r,), packed = self.row_axes(shape), self.packed_axes(shape)
            if self.paired_axes(shape):         # the step's cell and its example's cells
                if len(packed) != 1:
                    raise NoRule(f"a value of shape {tuple(shape)} inside a scan pairs its "
                                 f"step's cell with two packed lengths")
                d = shape[packed[0]]
                same = self.in_frame(d) & (self.sequence_index(d)
                                           == self.paired[self.var_of(d)][:, None])
                return spread(same, shape, (r, packed[0]))
            if len(packed) == 1:
                return spread(self.in_frame(shape[packed[0]]), shape, (r, packed[0]))
            p, q = packed
            if self.var_of(shape[p]) == self.var_of(shape[q]):
                same = (self.starts(shape[p], -1)[:, :, None]
                        == self.starts(shape[q], -2)[:, None, :])      # (rows, p, q)
            else:   # two variables' grids (cross-attention's (B, T, S)): the same example
                same = (jnp.where(self.in_frame(shape[p]), self.sequence_index(shape[p]),
                                  -1)[:, :, None]
                        == jnp.where(self.in_frame(shape[q]), self.sequence_index(shape[q]),
                                     -2)[:, None, :])
            return spread(same, shape, (r, p, q))
        return self._derive(("frame", tuple(shape)), make)

    def tail_mask(self, shape, axes, shared=None):
        """`Ctx.tail_mask`, made once per trace for a value with the rows axis: its lengths
        there are the frame's (`length`), whatever ``shared`` says, and ``alive`` is the
        same in every context of a trace (a scan's body has its own)."""
        if not self.row_axes(shape):
            return super().tail_mask(shape, axes, shared)
        return self._derive(("tail mask", tuple(shape), frozenset(axes)),
                            lambda: super(PackedCtx, self).tail_mask(shape, axes, shared))

    def frame_only(self, x, fill):
        """``x`` with ``fill`` outside its frame (see `frame`)."""
        return lax.select(self.frame(x.shape), x, self.filled(x.shape, fill, x.dtype))

    def ends(self, d):
        """``(rows, d)`` int32: per cell, the column where its sequence's part ends (-1 in
        padding), so ``column < ends`` is the frame."""
        def make():
            pos, seglen = self.cells(d)
            column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
            return jnp.where(pos >= 0, column - pos + self.at_lengths(d, seglen),
                             -1).astype(np.int32)
        return self._derive(("ends", d), make)

    def at_lengths(self, d, seglen, *, as_value: bool = False):
        """``d`` at each cell's sequence length (``seglen``): never below 0 as the length of
        an axis, as it is as a value (see `Ctx.per_row`)."""
        var = self.var_of(d)
        value = evaluate_dim(d, self.sizes if var is None else {**self.sizes, var: seglen})
        return (value if as_value else jnp.maximum(value, 0)).astype(np.int32)

    def _summed(self, d, rows: str):
        b = var_dim(rows, d.scope)
        q = d // b
        if q * b != d or rows in dim_vars(q):
            raise NoRule(f"the length {d} is not a count over the sequences")
        grid = self._grid_of(q)
        starts = grid.pos == 0
        per = (self.at_lengths(q, grid.seglen) if is_sym(q)
               else jnp.full(jnp.shape(grid.pos), int(q)))
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
        """Each sequence's own, held at every cell of it (`Known.per_sequence`) in the grid of
        its variable."""
        var = self.var_of(d) or self.var
        self.results = [self._per_sequence(None, var)]
        return self.at_lengths(d, self.grids[var].seglen, as_value=True)

    def count(self, d):
        if self.var_of(d) is not None:
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
        r, _ = self.frame_axes(shape, "a sort", along=axis)
        return spread(self.starts(shape[axis]), shape, (r, axis))

    # -- what `evaluate` asks of a layout (see `Ctx`) ---------------------------------------

    def held_outputs(self, eqn, invals) -> list | None:
        """A value that cannot be packed makes whatever reads it unpackable, at its line."""
        why = next((k.unpackable for k in self.operands if k.unpackable), None)
        if why is not None:
            self.flag(eqn, f"reads {why}")
            return self.not_packed(eqn, why)
        if any(k.per_row for k in self.operands):   # never made here; defensive
            self.flag(eqn, "reads a per-row value")
            return self.not_packed(eqn, "a per-row value")
        if len(self.grids) > 1 and any(k.per_sequence for k in self.operands):
            return self._in_one_grid(eqn, invals)
        return None

    def _in_one_grid(self, eqn, invals) -> list | None:
        """Several packed variables: per-sequence operands held in another grid than the
        equation's (an encoder's pooled state meeting the decoder's cells, a source-length
        input meeting target cells) are moved there first, each example's value to the cells
        of the same example (`moved_to`), and the equation evaluated again. None when every
        operand is in the equation's grid already."""
        shape_vars = self._shape_vars(eqn)
        homes = [k.sequence_var for k in self.operands if k.per_sequence]
        if len(shape_vars) > 1:
            why = "a per-sequence value meets the lengths of several packed variables"
            self.flag(eqn, why)
            return self.not_packed(eqn, why)
        target = shape_vars.pop() if shape_vars else homes[0]
        if all(h == target for h in homes):
            return None
        moved, known = [], []
        for x, k in zip(invals, self.operands):
            if k.per_sequence and k.sequence_var != target:
                x, k = self.moved_to(x, k, target), per_sequence(k.sequence_axis, target)
            moved.append(x)
            known.append(k)
        return self.evaluate(eqn, moved, known)

    def moved_to(self, x, known: Known, var: str):
        """``x``, held per sequence in its grid (``known``), held in ``var``'s grid instead:
        each cell of an example there reads the value at the first cell of the same example
        in the other grid (an example's parts share a packed row)."""
        source, target = self.grids[known.sequence_var], self.grids[var]

        def make():
            # (rows, target columns, source columns): the source column that starts the
            # target cell's example.
            same = ((target.sequence[:, :, None] == source.sequence[:, None, :])
                    & (source.pos == 0)[:, None, :] & (target.sequence >= 0)[:, :, None])
            return jnp.argmax(same, axis=2).astype(np.int32)
        column = self._derive(("moved", known.sequence_var, var), make)
        # Every example then has a first cell in every grid, an empty one too (`Logical`).
        self.recorder.reads_sequence = self.recorder.per_sequence = True
        a = 0 if known.sequence_axis is None else known.sequence_axis
        row = lax.broadcasted_iota(np.int32, jnp.shape(column), 0)
        return jnp.moveaxis(jnp.moveaxis(x, (a, a + 1), (0, 1))[row, column], (0, 1), (a, a + 1))

    def not_packed(self, eqn, why: str, outputs=None) -> list:
        """``eqn``'s outputs (those at ``outputs``; None: all), which cannot be packed: no
        value, annotated with ``why`` (`Known.unpackable`)."""
        outputs = range(len(eqn.outvars)) if outputs is None else outputs
        self.results = [Known(unpackable=why) if i in outputs else None
                        for i in range(len(eqn.outvars))]
        return [None] * len(eqn.outvars)

    def held_per_cell(self, values) -> list:
        """``values``, the outputs of the current equation, held per cell (`Known.per_cell`:
        the rows axis in front)."""
        self.results = [Known(per_cell=True)] * len(values)
        return values

    def held_per_sequence(self, values, axes) -> list:
        """``values``, this equation's outputs, held per sequence along rows axes ``axes``."""
        self.results = [self._per_sequence(a, self.var) for a in axes]
        return values

    def _per_sequence(self, axis: int | None, var: str) -> Known:
        if var in self.paired:
            raise NoRule(f"a value per sequence of {var} inside a scan over another length "
                         f"(each step's cell pairs with one example's {var})")
        return per_sequence(axis, var)

    def held_rule(self, eqn, invals):
        if any(k.per_cell for k in self.operands):
            return per_cell
        if any(k.per_sequence for k in self.operands):
            return _evaluate_per_sequence
        return None

    def refusal(self, eqn, invals) -> str | None:
        for v in eqn.outvars:
            why = self._of_shape("refusal", getattr(v.aval, "shape", ()), self._refuses)
            if why is not None:
                return why
        return moves_ragged_rows(self, eqn)

    def _refuses(self, shape) -> str | None:
        """Why no equation can make a value of ``shape`` in packed rows, None when one can."""
        for d in shape:
            try:
                var = self.var_of(d)
            except NoRule as e:
                return str(e)
            room = 0 if var is None else self.grids[var].room
            if not self.recorder.monotone(d) or not _fits(self.recorder, d, var,
                                                           self.rows_name, room):
                return (f"the length {d} can exceed its sequence's room in a packed row "
                        f"(a packed row leaves {room} cell(s) after each sequence; "
                        f"T + c with a constant c packs)")
            # A per-position value without rows has no frame to keep.
            if self.row_axes(shape) and not _keeps_start_columns(
                    self.recorder, d, var, self.rows_name):
                return (f"the length {d} is shorter than its sequence by more than a "
                        f"constant (a stride: x[:, ::2], a strided convolution): the "
                        f"part of a sequence that starts mid-row would lie past the end "
                        f"of the shorter packed row, so its outputs cannot start at its "
                        f"own column")
        return None

    def rule_for(self, eqn, entry):
        return entry.packed if entry is not None and entry.packed is not None else packed_generic

    def refused(self, eqn, invals, why: str) -> list:
        """Flagged: the plan cannot pack (it runs padded), and what reads the outputs says so."""
        self.flag(eqn, why)
        return self.not_packed(eqn, why)

    def without_rule(self, eqn, invals, error: NoRule) -> list:
        return self.refused(eqn, invals, str(error))

    def as_output(self, x, aval, known=None):
        if x is None or (known is not None and known.per_cell):    # not packed, or per cell
            return x
        return like_aval(x, aval)

    def positions_of(self, eqn, reading):
        return positions_recipe(eqn, reading)

    def without_rows(self, eqn, invals) -> list:
        """An elementwise equation of a per-sequence number and positions, without the rows
        axis (``jnp.arange(T) / T``): per cell (`Known.per_cell`)."""
        return per_cell(self, eqn, invals)

    def refuse_per_sequence(self, eqn, what: str, outputs=None) -> list:
        where = equation_line(eqn) or "<unknown>"
        return self.not_packed(eqn, f"{what} made at {where}, a per-sequence value (a packed "
                                    f"row holds several sequences)", outputs)


def along(v2, ndim: int, rows_axis: int, packed_axis: int):
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

    def decide() -> bool:
        if names != {var}:
            return False
        lo, hi = dim_bounds(var_dim(var, d.scope))
        return bool(np.isfinite(hi) and hi - lo <= 1 << 14) and holds(
            [(n, int(evaluate_dim(d, {var: n}))) for n in range(max(int(lo), 0), int(hi) + 1)])

    return recorder.decided((what, d), decide)


def _fits(recorder: Recorder, d, var: str, rows: str, room: int) -> bool:
    """Whether a packed length never exceeds its sequence and the ``room`` cells after it:
    ``d(n) <= n + room`` for every n within the variable's bounds (a sequence's part of the
    axis stays inside its own cells)."""
    return _for_every_length(recorder, ("fits", room), d, var, rows,
                             lambda pairs: all(e <= n + room for n, e in pairs))


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

def scatter_window(eqn) -> list:
    """A scatter's window along each operand axis: 1 where a dimension is inserted (or
    batched), else the update's window sizes in order."""
    dn, update_shape = eqn.params["dimension_numbers"], eqn.invars[2].aval.shape
    sizes = iter(update_shape[d] for d in dn.update_window_dims)
    return [1 if a in dn.inserted_window_dims or a in dn.operand_batching_dims else next(sizes)
            for a in range(len(eqn.invars[0].aval.shape))]


def packed_generic(ctx: PackedCtx, eqn, invals):
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


def _refuse_indexing_across_sequences(ctx: PackedCtx, eqn) -> None:
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


def _refuse_windows_of_packed_length(ctx: PackedCtx, eqn) -> None:
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
        window = scatter_window(eqn)
    for a in set(ctx.row_axes(shape)) - set(batching):
        if not same_dim(window[a], shape[a]):
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


def _drop_dead_rows(ctx: PackedCtx, eqn, invals):
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


def _implicit_broadcasts(ctx: PackedCtx, eqn, invals):
    """Elementwise operands of a unit rows axis (``x + pe[:T]`` adds ``(B, T)`` and ``(1, T)``
    with no ``broadcast_in_dim`` between): a per-position value broadcast over the rows,
    placed by position like `_broadcast_in_dim` places it."""
    out = getattr(eqn.outvars[0].aval, "shape", ())
    rows, packed = ctx.row_axes(out), ctx.packed_axes(out)
    if len(rows) != 1 or len(packed) not in (1, 2) or eqn.primitive.name in ("transpose",
                                                                              "squeeze"):
        return None
    r = rows[0]
    changed, new = False, []
    for x in invals:
        # Kept as is: an operand with the rows axis (most: asked first) or not lined up.
        along = [t for t in packed if t in ctx.packed_axes(x.shape)] if (
            jnp.ndim(x) == len(out) and not is_sym(x.shape[r]) and all(
                not is_sym(d) and d == 1 or same_dim(d, o) for d, o in zip(x.shape, out))) else ()
        if along:
            dims = tuple(a for a in range(len(out)) if a != r)
            shape = tuple(out[r] if a == r else d for a, d in enumerate(x.shape))
            x = by_position(ctx, lax.squeeze(x, (r,)), dims, shape, r, along)
            changed = True
        new.append(x)
    return bind_eqn(eqn, new) if changed else None


def _reduction(ctx: PackedCtx, eqn, invals, fills, axes):
    """`PackedCtx.reduce`: over every real cell, within each sequence, or per position."""
    x, axes = invals[0], set(axes)
    rows, packed = set(ctx.row_axes(x.shape)), set(ctx.packed_axes(x.shape))
    if ctx.paired_axes(x.shape):
        return _paired_reduction(ctx, eqn, invals, fills, axes, rows, packed)
    arg = eqn.primitive.name in ("argmax", "argmin")
    padded = functools.partial(Ctx.reduce, ctx, eqn, invals, fills, tuple(axes))
    if not rows:                       # per position: real up to the longest sequence
        return padded()
    if len(packed) == 2:               # pairs of cells (attention's scores): within a sequence
        if rows <= axes and not axes & packed and segment_of(eqn.primitive.name):
            return [_over_positions(ctx, eqn, x, *rows, *sorted(packed))]
        if arg or not (axes & packed == packed if rows <= axes else len(axes & packed) == 1):
            return ctx.refuse_per_sequence(
                eqn, f"{eqn.primitive.name} over part of a packed value")
        n = len(fills)
        return bind_eqn(eqn, [*(ctx.frame_only(v, f) for v, f in zip(invals[:n], fills)),
                           *invals[n:]])
    if packed:
        if rows | packed <= axes and not arg:
            return padded()                     # over every real cell
        if packed <= axes and not rows & axes and eqn.primitive.name != "reduce":
            return along_sequences(ctx, eqn, x, *rows, *packed)
        if rows <= axes and not packed & axes and segment_of(eqn.primitive.name):
            return [_over_positions(ctx, eqn, x, *rows, *sorted(packed))]
        return ctx.refuse_per_sequence(eqn, f"{eqn.primitive.name} over part of a packed value")
    if ctx.alive is not None and not arg:       # inside a packed scan: over its real rows
        return padded()
    return ctx.refuse_per_sequence(eqn, f"{eqn.primitive.name} over the rows")


def _paired_reduction(ctx: PackedCtx, eqn, invals, fills, axes, rows, packed):
    """Inside a scan over one length, a reduction of a value paired with the step's cell
    (softmax over the encoder's cells at a decoder step): over the cells of the step's
    example only, the result one per row as the step's other values are."""
    if eqn.primitive.name in ("argmax", "argmin"):
        raise NoRule(f"{eqn.primitive.name} over cells paired with a scan's step (a column "
                     f"of the packed row, not a position in the example)")
    if rows & axes and not packed <= axes:
        raise NoRule(f"{eqn.primitive.name} over the rows of a value paired with a scan's "
                     f"step, not over the other length")
    n = len(fills)
    return bind_eqn(eqn, [*(ctx.frame_only(v, f) for v, f in zip(invals[:n], fills)),
                          *invals[n:]])


def _over_positions(ctx: PackedCtx, eqn, x, r: int, *packed: int):
    """A reduction over the rows that keeps the packed lengths (the gradient of a learned
    ``pe[:T]`` added to every row, or of a ``(T, T)`` position bias added to attention's
    scores): per position, over the cells of every sequence at that position (one packed axis)
    or pair of positions (two) -- a scatter by position, as the pad layout reduces each
    position over the rows long enough to hold it. A position no sequence reaches holds the
    identity, as padded."""
    name = eqn.primitive.name
    fill = REDUCERS[name].identity(x.dtype)
    x = lax.select(ctx.frame(x.shape), x, filled(x.shape, fill, x.dtype))
    x, (r, *packed) = others_first(eqn, x, eqn.params["axes"], (r, *packed))
    exact = x.dtype == np.bool_
    xs = jnp.moveaxis(x.astype(np.int8) if exact else x, (r, *packed), range(1 + len(packed)))
    sizes = xs.shape[1:1 + len(packed)]
    index = []
    for k, n in enumerate(sizes):       # (rows, n) positions, spread over the pair's axes
        pos, _ = ctx.cells(n)
        at = jnp.where(ctx.in_frame(n), pos, n)                      # n: dropped
        index.append(jnp.expand_dims(at, [1 + j for j in range(len(sizes)) if j != k]))
    total = filled((*sizes, *xs.shape[1 + len(packed):]), int(fill) if exact else fill, xs.dtype)
    out = getattr(total.at[tuple(index)], segment_of(name))(xs, mode="drop").astype(x.dtype)
    return jnp.moveaxis(out, range(len(packed)), [p - (r < p) for p in packed])


def shifted_within(ctx: PackedCtx, x, rows_axis: int, axis: int, offset: int, length, fill=0):
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
    real = ctx.in_frame(length) & (source >= 0) & (source < ctx.at_lengths(n, seglen))
    return lax.select(spread(real, shifted.shape, (rows_axis, axis)), shifted,
                      filled(shifted.shape, fill, x.dtype))


def _window(ctx: PackedCtx, eqn, x, monoid):
    """`PackedCtx.window`: a window along a packed length with stride 1 (a moving sum,
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
    combine, identity = monoid.combine, monoid.identity
    fill, step, length = identity(x.dtype), p["window_dilation"][a], eqn.outvars[0].aval.shape[a]
    out = None
    for k in range(p["window_dimensions"][a]):
        tap = shifted_within(ctx, x, rows[0], a, k * step - lo, length, fill)
        out = tap if out is None else combine(out, tap)
    return [out]


def _reversed_sequences(ctx: PackedCtx, x, a: int):
    """`PackedCtx.reverse`: reversing a packed length reverses each sequence in place: the
    cell at position ``p`` of a part of ``e`` cells reads its own sequence's position
    ``e - 1 - p``, at column ``start + e - 1 - p``; cells outside the frame keep their own. A
    reverse is its own transpose, so gradients come back through this rule too."""
    r, _ = ctx.frame_axes(x.shape, "a reverse", along=a)
    return reverse_each(ctx, x, r, a)


def reverse_each(ctx: PackedCtx, x, r: int, a: int, others=()):
    """``x`` (rows axis ``r``) with each sequence reversed in place along its packed axis
    ``a``, and the axes ``others`` reversed as they are."""
    if others:
        x = lax.rev(x, others)
    n = x.shape[a]
    pos, seglen = ctx.cells(n)
    column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
    source = jnp.where(ctx.in_frame(n), column - 2 * pos + ctx.at_lengths(n, seglen) - 1, column)
    return take_rows(ctx, x, spread(source, x.shape, (r, a)), a)


def _top_per_sequence(ctx: PackedCtx, eqn, x, a: int):
    """`PackedCtx.top_k`: each sequence's own ``k`` largest and their positions, held at
    every cell of the sequence (`Known.per_sequence`). Each sequence is sorted in place (its start
    column the first key, `sort_key`), ascending by value as ``top_k`` ranks it (`ranked`)
    and, among equal values, descending by position, so its ``k`` largest are its last ``k``
    cells read backwards, the lower position first among ties, as ``top_k`` breaks them."""
    shape, k = x.shape, eqn.params["k"]
    if is_sym(k) or (ctx.row_axes(shape), ctx.packed_axes(shape), a) != ([0], [a], x.ndim - 1):
        raise NoRule(f"top_k of a value of shape {tuple(shape)}, k = {k} (packed rows take a "
                      f"constant k, the rows first and the packed length last)")
    n = shape[a]
    position = spread(ctx.cells(n)[0], shape, (0, a))
    *_, negated, ascending = lax.sort((ctx.sort_key(shape, a), ranked(x), -position, x),
                                      dimension=a, num_keys=3)
    # Per cell of the grid and rank j: the column holding its sequence's j-th largest.
    j = lax.broadcasted_iota(np.int32, (1, 1, k), 2)
    count = ctx.at_lengths(n, ctx.seglen)[..., None]
    column = jnp.clip(ctx.sequence_starts()[..., None] + count - 1 - j, 0, n - 1)
    real = (j < count) & (ctx.pos >= 0)[..., None]
    rows = lax.broadcasted_iota(np.int32, column.shape, 0)

    def pick(v):        # (rows, *F, n) -> (rows, columns, *F, k), and where it is real
        got = jnp.moveaxis(jnp.moveaxis(v, a, 1)[rows, column], 2, -1)
        return got, spread(real, got.shape, (0, 1, got.ndim - 1))

    values, keep = pick(ascending)
    values = jnp.where(keep, values, lowest_value(x.dtype))
    positions, _ = pick(-negated)
    positions = jnp.where(keep, positions, lax.broadcasted_iota(
        positions.dtype, positions.shape, positions.ndim - 1))
    return ctx.held_per_sequence(
        [values, positions.astype(eqn.outvars[1].aval.dtype)], [0, 0])


def _cumulative(ctx: PackedCtx, eqn, x, a: int, monoid, reverse: bool):
    """`PackedCtx.accumulate`: a cumulative op along a packed length runs per sequence: a
    scan over the columns whose running value restarts at each sequence's first cell (its last
    with ``reverse=True``, as the transpose of ``cumsum`` runs). Exact, where subtracting each
    sequence's prefix of the row would lose the sequence's own digits; sequential over the row
    length."""
    r, _ = ctx.frame_axes(x.shape, eqn.primitive.name, along=a)
    combine, identity = monoid.combine, monoid.identity
    n = x.shape[a]
    pos, seglen = ctx.cells(n)
    restart = pos == (ctx.at_lengths(n, seglen) - 1 if reverse else 0)
    columns = jnp.moveaxis(x, a, 0)
    restarts = jnp.moveaxis(spread(restart, x.shape, (r, a)), a, 0)
    start = filled(columns.shape[1:], identity(x.dtype), x.dtype)

    def step(total, cell):
        value, restarts_here = cell
        total = combine(lax.select(restarts_here, start, total), value)
        return total, total

    _, out = lax.scan(step, start, (columns, restarts), reverse=reverse)
    return [jnp.moveaxis(out, 0, a)]


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
    rows_names = {rows for _, rows in rows_at.values()}
    if len(rows_names) != 1:
        why = ("no input gives per-sequence lengths (a `lengths_of` Spec)" if not rows_at else
               f"the ragged length variables are ragged along different rows "
               f"({', '.join(sorted(rows_names))})")
        return Logical(fn=replay(closed_jaxpr), rewritten=0,
                       unsupported=(Unsupported("layout", "<inputs>", why),))
    (rows,) = rows_names
    # Each packed variable its own grid (its rows' columns and the room after the last
    # sequence), an example's parts in the same row of each; its layout inputs, in this order.
    names = sorted(rows_at)
    rooms = {var: room_needed(jaxpr, var) for var in names}
    dims = [d for v in jaxpr.invars for d in getattr(v.aval, "shape", ()) if is_sym(d)]
    shapes = {var: jax.export.symbolic_shape(
        f"{rows}, {var} + {rooms[var]}" if rooms[var] else f"{rows}, {var}", scope=dims[0].scope)
        for var in names}
    # A (B,) input (the lengths, labels) is held per sequence in the grid of the variable
    # it gives the lengths of, another in the first grid (values move between grids as
    # equations need, `PackedCtx.moved_to`).
    home = {at: var for var, (at, _) in rows_at.items()}

    def held_per_cell(shape):
        """Inputs with the rows axis and no packed length (the lengths, labels): per cell."""
        r = [a for a, d in enumerate(shape) if is_sym(d) and str(d) == rows]
        packed = [d for d in shape if not dim_vars(d).isdisjoint(rows_at)]
        return r[0] if len(r) == 1 and not packed else None

    def packed(*args):
        flat, layout = args[:-3 * len(names)], args[-3 * len(names):]
        sizes = {name: flat[at] for name, at in sizes_at.items()}
        grids = {var: Grid(*layout[3 * i:3 * i + 3], room=rooms[var])
                 for i, var in enumerate(names)}
        ctx = PackedCtx(sizes, recorder, grids=grids, rows=rows,
                        var=names[0] if len(names) == 1 else None)
        known = [PLAIN if a is None else per_sequence(a, home.get(i, names[0]))
                 for i, a in enumerate(held_per_cell(getattr(v.aval, "shape", ()))
                                       for v in jaxpr.invars)]
        outs = eval_jaxpr(ctx, jaxpr, closed_jaxpr.consts, flat, known)
        results = [k or PLAIN for k in ctx.results]
        ctx = ctx.in_grid(names[0])     # per-sequence outputs come back in the first grid
        for i, (out, v, k) in enumerate(zip(outs, jaxpr.outvars, results)):
            shape = getattr(v.aval, "shape", ())
            made = k.unpackable or (k.per_cell and "a per-cell value") or (
                k.per_sequence and k.sequence_axis is None and "a per-sequence number")
            if held_per_cell(shape) is not None and not made:   # per sequence
                recorder.per_sequence = True
                if k.per_sequence and k.sequence_var != names[0]:
                    out, k = (ctx.moved_to(out, k, names[0]),
                              per_sequence(k.sequence_axis, names[0]))
                outs[i], _ = held(ctx, out, shape, k)
            elif made or (ctx.row_axes(shape) and len(ctx.packed_axes(shape)) not in (1, 2)):
                made = made or "a per-sequence value"
                recorder.unsupported.setdefault(("output", i), Unsupported(
                    "output", f"output {i}", f"returns {made}"))
                outs[i] = filled(v.aval.shape, 0, v.aval.dtype)
        return tuple(outs)

    avals = []
    for i, v in enumerate(jaxpr.invars):
        shape, a = tuple(v.aval.shape), held_per_cell(getattr(v.aval, "shape", ()))
        if a is not None:
            shape = (*shape[:a + 1], shapes[home.get(i, names[0])][1], *shape[a + 1:])
        avals.append(jax.ShapeDtypeStruct(shape, v.aval.dtype, weak_type=v.aval.weak_type))
    for var in names:
        avals += [jax.ShapeDtypeStruct(tuple(shapes[var]), np.int32)] * 3
    traced = jax.jit(packed).trace(*avals).jaxpr
    fn = replay(traced)
    if len(names) == 1 and not recorder.reads_sequence:
        # No rule read the sequence index: the program does not take it (one int32 array per
        # cell less to build and send each call); the traced program gets a placeholder.
        # (Several variables' programs take every grid's, to find an example's cells.)
        avals.pop()
        fn = functools.partial(_without_sequence, fn)
    return Logical(fn=fn, unsupported=tuple(recorder.unsupported.values()),
                   rewritten=len(recorder.rewritten), avals=tuple(avals),
                   per_sequence=recorder.per_sequence,
                   reads_sequence=recorder.reads_sequence or len(names) > 1,
                   rooms=rooms)


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
