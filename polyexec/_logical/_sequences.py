"""Per-sequence values of packed rows (``layout="pack"``): their form and interpreter; their
rules (``layout="per_sequence"``) are in each primitive's family module.

A value with the rows axis and no packed length has one entry per sequence: a scan's final
carry, ``x[:, -1]``, a sum over T alone, a ``(B,)`` input such as the labels. A packed row
holds several sequences, so such a value is held at every cell of its sequence
(`Known.per_sequence`): the logical value with the grid's columns inserted after its rows
axis (``Known.sequence_axis``), cell ``(r, c)`` holding the entry of the sequence that
occupies it. A number per sequence without a rows axis (``x.shape[1]``) is held with leading
``(rows, columns)`` axes. A rule reads its operands' forms in ``ctx.operands`` and states its
outputs' with `PackedCtx.held_per_sequence`; the helpers below take the held value and its
rows axis.

- An equation that treats the rows independently (elementwise maths, a head ``h @ W``,
  ``log_softmax``, a gather batched over the rows) runs once per column: ``jax.vmap`` over the
  inserted axis, where row ``r`` of column ``c`` is the sequence at cell ``(r, c)``.
- One that combines the rows (a mean over the sequences, a weight gradient ``h.T @ g``) reads
  each sequence once, at its first cell.
- Broadcasting one back along the length (``h[:, None] + x``, ``x / x.shape[1]``) gives each
  cell its own sequence's entry.
- The packed rules (in each primitive's family module) make them (reductions along the
  length alone, picking one position ``x[:, k]``, a scan's final carry, ``dim_as_value``)
  and read them as a scan's initial carry or constant (an encoder's state, the gradient of a
  final carry) at each sequence's first step, or as the update of a scatter into one
  position (``x[:, -1]``'s gradient).

Every sequence has a first cell: one of length 0 gets a cell of its own, outside the frame of
every length (``pos`` 0, ``seglen`` 0), so its per-sequence values exist too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._basics import Known, PLAIN, bind_eqn, bind_eqn_with, filled, is_sym
from ._families import REDUCERS
from ._registry import ELEMENTWISE, NoRule, lookup_rule


def per_sequence(axis: int | None, var: str) -> Known:
    """The annotation of a value held per sequence in the grid of the packed variable ``var``
    whose logical rows axis is ``axis`` (None: a number per sequence, held with leading
    ``(rows, columns)`` axes)."""
    return Known(per_sequence=True, sequence_axis=axis, sequence_var=var)


def spread(v, shape, targets):
    """``v`` broadcast to ``shape``, its axes going to the axes ``targets`` (in any order)."""
    order = sorted(range(len(targets)), key=targets.__getitem__)
    return lax.broadcast_in_dim(jnp.transpose(v, order), tuple(shape), tuple(sorted(targets)))


def grid_shape(ctx, shape, axis):
    """The shape a per-sequence value of logical ``shape`` is held in."""
    rows, columns = ctx.pos.shape
    if axis is None:
        return (rows, columns, *shape)
    return (*shape[:axis + 1], columns, *shape[axis + 1:])


def held(ctx, x, shape, known: Known):
    """``x`` (logical ``shape``, one rows axis; annotated ``known``) held per sequence, and
    its rows axis: a plain value is the same for every sequence (``jnp.zeros((B, H))``: a
    broadcast), so every column holds it."""
    if known.per_sequence:
        return x, known.sequence_axis
    (r,) = ctx.row_axes(shape)
    return lax.broadcast_in_dim(x, grid_shape(ctx, shape, r),
                                tuple(a + (a > r) for a in range(len(shape)))), r


def at_column(x, axis: int, column):
    """The logical value at one column of ``x`` held per sequence along its rows axis
    ``axis``: row ``r`` holds the sequence at cell ``(r, column)``."""
    return lax.dynamic_index_in_dim(x, column, axis + 1, keepdims=False,
                                    allow_negative_indices=False)


def first_only(ctx, x, axis: int | None, fill):
    """``x`` (held per sequence, its rows axis ``axis``) with ``fill`` everywhere but at each
    sequence's first cell: summed over the rows and columns, every sequence counts once."""
    first = ctx.pos == 0
    targets = (0, 1) if axis is None else (axis, axis + 1)
    keep = spread(first, x.shape, targets)
    return lax.select(keep, x, filled(x.shape, fill, x.dtype))


def by_cell(grid, axis):
    """``(rows, columns, *rest)`` -> held per sequence with its logical rows axis ``axis``."""
    return jnp.moveaxis(grid, (0, 1), (axis, axis + 1))


def shapes_of(vs):
    return [tuple(getattr(v.aval, "shape", ())) for v in vs]


# --------------------------------------------------------------------------------------------
# Reductions along a packed length: each sequence's own

def segment_of(name: str) -> str | None:
    """How a reduction along the length combines each sequence's cells (its `Monoid.segment`);
    None for one that cannot (an arg-reduction, ``reduce_xor``, ``reduce``)."""
    monoid = REDUCERS.get(name)
    return monoid.segment if monoid is not None else None


def along_sequences(ctx, eqn, x, r: int, p: int) -> list:
    """A reduction along a packed length that keeps the rows (``jnp.sum(x, axis=1)``,
    ``jnp.argmax(logits, axis=1)``): per sequence, over its own cells -- a scatter into each
    sequence's start column, read back at every cell of the sequence. ``argmax``/``argmin``
    give the position inside the sequence (its first extreme, or its first NaN, as jnp)."""
    name = eqn.primitive.name
    if REDUCERS[name].combine is not None and segment_of(name) is None:   # not an arg-reduction
        raise NoRule(f"{name} along a packed length")
    frame = ctx.frame(x.shape)
    axes = tuple(eqn.params["axes"])
    if name in ("argmax", "argmin"):
        best = "max" if name == "argmax" else "min"
        nan = jnp.isnan(x) & frame if jnp.issubdtype(x.dtype, jnp.inexact) else frame & False
        fill = REDUCERS[name].identity(x.dtype)
        clean = lax.select(frame & ~nan, x, filled(x.shape, fill, x.dtype))
        extreme = segments(ctx, clean, r, p, best, fill)
        has_nan = segments(ctx, nan.astype(np.int8), r, p, "max", 0)
        at = functools.partial(read_cells, ctx, ctx.starts(x.shape[p], 0), r, p)
        hit = frame & jnp.where(at(has_nan) > 0, nan, clean == at(extreme))
        position = spread(ctx.cells(x.shape[p])[0], x.shape, (r, p))
        big = np.iinfo(np.int32).max
        first = segments(ctx, jnp.where(hit, position, big).astype(np.int32), r, p, "min", big)
        out = jnp.where(first == big, 0, first).astype(eqn.params["index_dtype"])
    else:
        fill = REDUCERS[name].identity(x.dtype)
        x = lax.select(frame, x, filled(x.shape, fill, x.dtype))
        x, (r, p) = others_first(eqn, x, axes, (r, p))
        exact = x.dtype == np.bool_
        out = segments(ctx, x.astype(np.int8) if exact else x, r, p, segment_of(name),
                        int(fill) if exact else fill)
        out = out.astype(x.dtype)
    (r_out,) = ctx.row_axes(eqn.outvars[0].aval.shape)
    return ctx.held_per_sequence([by_cell(out, r_out)], [r_out])


def segments(ctx, x, r: int, p: int, how: str, fill):
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
    return read_cells(ctx, ctx.sequence_starts(), 0, 1, total)


def read_cells(ctx, starts, r, p, grid):
    """A ``(rows, columns, *rest)`` grid of per-sequence entries (at each sequence's start
    column) read at cells whose starts are ``starts`` (``(rows, n)``), with the rows and the
    cells going to axes ``r`` and ``p``."""
    row = lax.broadcasted_iota(np.int32, jnp.shape(starts), 0)
    return jnp.moveaxis(grid[row, starts], (0, 1), (r, p))


def others_first(eqn, x, axes, kept):
    """Reduction ``eqn`` of ``x`` over its ``axes`` other than ``kept``, per cell, and where
    the ``kept`` axes are after it: the reduction along the packed axes comes next."""
    others = tuple(a for a in axes if a not in kept)
    if not others:
        return x, tuple(kept)
    return (bind_eqn_with(eqn, [x], axes=others)[0],
            tuple(k - sum(a < k for a in others) for k in kept))


# --------------------------------------------------------------------------------------------
# Equations reading per-sequence values

def evaluate(ctx, eqn, invals) -> list:
    """One equation with an operand held per sequence (`Known.per_sequence`)."""
    ctx.recorder.per_sequence = True
    entry = lookup_rule(eqn.primitive)
    if entry is not None and entry.per_sequence is not None:
        out = entry.per_sequence(ctx, eqn, invals)
        if out is not None:
            return out
    if entry is not None and entry.inline:
        return entry.rule(ctx, eqn, invals)       # a call: its equations meet the value
    return _per_column(ctx, eqn, invals, entry)


def _per_column(ctx, eqn, invals, entry) -> list:
    name = eqn.primitive.name
    shapes, out_shapes = shapes_of(eqn.invars), shapes_of(eqn.outvars)
    known = ctx.operands
    elementwise = entry is not None and entry.rule is ELEMENTWISE
    if any(ctx.packed_axes(s) for s in out_shapes):
        if not elementwise or name in ("broadcast_in_dim", "iota"):
            raise NoRule(f"{name} of a per-sequence value and a packed length")
        if not ctx.row_axes(out_shapes[0]):
            return ctx.without_rows(eqn, invals)    # positions of each sequence: per cell
        # Then as any packed equation (a per-position operand, ``iota < lengths[:, None]``'s
        # ``(1, T)`` iota, is placed by position).
        return ctx.evaluate(eqn, [to_cells(ctx, x, k.sequence_axis, s, out_shapes[0])
                                  if k.per_sequence else x
                                  for x, k, s in zip(invals, known, shapes)],
                            [PLAIN if k.per_sequence else k for k in known])
    if any(ctx.packed_axes(s) for s in shapes):
        raise NoRule(f"{name} of a per-sequence value and a value along a packed length")
    acts_on = None if entry is None or elementwise else entry.acts_on
    if not elementwise and acts_on is None:
        raise NoRule(f"{name} has no rule for a per-sequence value of packed rows")
    for i, (k, s) in enumerate(zip(known, shapes)):
        if (k.per_sequence and k.sequence_axis is not None and acts_on is not None
                and acts_on(eqn, i, k.sequence_axis, s)):
            raise NoRule(f"{name} along the sequences of a per-sequence value")
    rowless = [k.per_sequence and k.sequence_axis is None for k in known]
    rowful = any(k.per_sequence and k.sequence_axis is not None for k in known) or any(
        ctx.row_axes(s) for s in shapes)
    if any(rowless) and not rowful:
        # Numbers per sequence (``x.shape[1] - 1``): once per cell.
        if any(ctx.row_axes(s) for s in out_shapes):
            raise NoRule(f"{name} makes rows of a per-sequence number")
        axes = [0 if r else None for r in rowless]
        run = jax.vmap(jax.vmap(lambda *xs: tuple(bind_eqn(eqn, list(xs))), axes), axes)
        return ctx.held_per_sequence(list(run(*invals)), [None] * len(out_shapes))
    in_axes = [k.sequence_axis + 1 if k.per_sequence and k.sequence_axis is not None
               else None for k in known]
    if any(rowless):
        # A number per sequence meets rows: an elementwise scalar, held at the rows' shape.
        if not elementwise or any(r and s != () for r, s in zip(rowless, shapes)):
            raise NoRule(f"{name} of a per-sequence number and a per-sequence value")
        (out,) = out_shapes
        (r,) = ctx.row_axes(out)
        invals = [spread(x, grid_shape(ctx, out, r), (r, r + 1)) if is_rowless else x
                  for x, is_rowless in zip(invals, rowless)]
        in_axes = [r + 1 if is_rowless else a for a, is_rowless in zip(in_axes, rowless)]
    out_axes = []
    for s in out_shapes:
        rows = ctx.row_axes(s)
        if len(rows) != 1:
            raise NoRule(f"{name} of a per-sequence value "
                          f"{'combines the sequences' if not rows else 'pairs the sequences'}")
        out_axes.append(rows[0])
    run = jax.vmap(lambda *xs: tuple(bind_eqn(eqn, list(xs))), in_axes=in_axes,
                   out_axes=tuple(a + 1 for a in out_axes))
    return ctx.held_per_sequence(list(run(*invals)), out_axes)


def to_cells(ctx, x, axis: int | None, shape, out):
    """An operand held per sequence (its rows axis ``axis``) of an elementwise equation along
    a packed length (``h[:, None] + x`` after jnp's ``(B, 1, H)`` broadcast, ``x /
    x.shape[1]``): each cell reads its own sequence's entry, as a value of the output's
    ``shape``."""
    frame = ctx.one_frame(out)
    if frame is None:
        raise NoRule(f"a per-sequence value meets a value of shape {tuple(out)}")
    r, p = frame
    if axis is None:
        if shape != ():
            raise NoRule("a per-sequence number of more than one entry meets a packed length")
        return spread(lax.slice_in_dim(x, 0, out[p], axis=1), out, (r, p))
    if len(shape) != len(out) or axis != r or is_sym(shape[p]) or shape[p] != 1:
        raise NoRule(f"a per-sequence value of shape {tuple(shape)} meets a value of shape "
                      f"{tuple(out)}")
    v = lax.squeeze(x, (p + (p > r),))                  # its unit axis gives way to the columns
    labels = [a for a in range(len(shape)) if a != p]
    labels.insert(labels.index(r) + 1, "columns")
    v = lax.slice_in_dim(v, 0, out[p], axis=labels.index("columns"))
    return spread(v, out, [p if a == "columns" else a for a in labels])


def refused(ctx, eqn, invals):
    """The per-sequence rule of a primitive that reads along an axis a per-sequence value
    holds per column (a window, a dynamic slice, a branch): refused by name."""
    raise NoRule(f"{eqn.primitive.name} of a per-sequence value has no packed rule")
