"""Rules for primitives that move positions along a length axis: reversal, tiling, sorting,
reshaping, and the pieces of ``slice``/``split``/``concatenate``/``pad``.

- ``rev``: a gather of ``t - 1 - i``; ``tile`` of a length axis: a gather of ``i mod t``.
- ``sort`` (``argsort``): an extra leading key "is tail" keeps the tail last; ``top_k``: the
  tail becomes the dtype's lowest value (``top_k`` breaks ties towards the lower index).
- ``slice``/``split``/``concatenate``/``pad``: pieces start at logical offsets (gathers where an
  offset is a length expression); ``pad`` writes its value from the logical end on.
- ``reshape``: passes through when it keeps each length axis' logical block a prefix (only unit
  axes added or removed; one length axis, same constant row count before it:
  ``(T, 4) <-> (4*T,)``; or constant axes regrouped around unchanged length axes:
  ``(B, T, 256) <-> (B, T, 4, 64)``); any other reshape (e.g.
  ``(B, T, H) -> (B*T, H)``) is a gather that lays out the logical elements row-major.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax_internals import definitely_equal, definitely_equal_shape, var_dim
from ._basics import (PLAIN, acts_along_params, bind_eqn, filled, iota_along, is_empty,
                      is_sym, operand_avals, same_dim)
from ._core import place_window, take_clamped, take_rows
from ._registry import ELEMENTWISE, PAD_AND_PACK, NoRule, deffacts, defrule, padded_rule
from ._cells import by_position, onto_cells
from ._packed import PackedCtx, along, reverse_each
from ._sequences import grid_shape, held, per_sequence, refused, spread, to_cells


def _rev_moves(eqn):
    return [(operand_avals(eqn)[0], tuple(eqn.params["dimensions"]))]


@defrule("rev", layout=PAD_AND_PACK, moves=_rev_moves, acts_on=acts_along_params)
def _rev(ctx, eqn, invals):
    """One rule for both layouts: each length axis is reversed in place by the layout (a
    padded row within its real length, each packed sequence within its own cells:
    `Ctx.reverse`); the other axes as written."""
    (x,) = invals
    dims = eqn.params["dimensions"]
    sym = [a for a in dims if is_sym(x.shape[a])]
    if not sym:
        return None
    fixed = tuple(a for a in dims if a not in sym)
    if fixed:
        x = lax.rev(x, fixed)
    for a in sym:
        x = ctx.reverse(x, a)
    return [x]


@defrule("tile")
def _tile(ctx, eqn, invals):
    (x,) = invals
    reps = eqn.params["reps"]
    sym = [a for a, r in enumerate(reps) if r != 1 and is_sym(x.shape[a])]
    if not sym:
        return None
    # Tile the other axes as written, then each length axis as a gather of ``i mod t``: the
    # copies follow one another at the real length, not the bucket's.
    fixed = tuple(1 if a in sym else r for a, r in enumerate(reps))
    if any(r != 1 for r in fixed):
        x = lax.tile(x, fixed)
    for a in sym:
        n = x.shape[a]
        x = take_clamped(ctx, x, iota_along((reps[a] * n,), 0) % ctx.length(n), a)
    return [x]


def _sort_moves(eqn):
    return [(aval, (eqn.params["dimension"],)) for aval in operand_avals(eqn)]


@defrule("sort", layout=PAD_AND_PACK, moves=_sort_moves, acts_on=acts_along_params)
def _sort(ctx, eqn, invals):
    d = eqn.params["dimension"]
    shape = invals[0].shape
    if not is_sym(shape[d]):
        return None
    # The layout's leading key keeps each real cell's order and place (`Ctx.sort_key`);
    # within the real positions the order, ties and stability are the original keys'.
    out = lax.sort_p.bind(ctx.sort_key(shape, d), *invals, dimension=d,
                          is_stable=eqn.params["is_stable"], num_keys=eqn.params["num_keys"] + 1)
    return list(out[1:])


def _top_k_axis(eqn, x) -> int:
    axis = eqn.params.get("axis", x.ndim - 1)
    return axis + x.ndim if axis < 0 else axis


def _top_k_window(eqn, invals):
    """``top_k`` reads ``k`` positions (``jax.jit`` refuses a row shorter than ``k``): a
    window from 0, which makes a row shorter than it refused by name (`RowFloor`)."""
    return [(_top_k_axis(eqn, invals[0]), 0, eqn.params["k"])]


@defrule("top_k", layout=PAD_AND_PACK, window=_top_k_window)
def _top_k(ctx, eqn, invals):
    (x,) = invals
    axis = _top_k_axis(eqn, x)
    if not is_sym(x.shape[axis]):
        return None
    return ctx.top_k(eqn, x, axis)



def _slice_moves(eqn):
    (aval,), p = operand_avals(eqn), eqn.params
    strides = p["strides"] or (1,) * len(aval.shape)
    axes = tuple(a for a in range(len(aval.shape)) if (p["start_indices"][a], strides[a]) != (0, 1)
                 or not same_dim(p["limit_indices"][a], aval.shape[a]))
    return [(aval, axes)] if axes else []


def _slice_window(eqn, invals):
    p, shape, out = eqn.params, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    strides = p["strides"] or (1,) * len(shape)
    return [(a, p["start_indices"][a], (out[a] - 1) * strides[a] + 1) for a in range(len(shape))]


def _slice_acts_on(eqn, i, axis, shape):
    p = eqn.params
    return (p["start_indices"][axis] != 0 or str(p["limit_indices"][axis]) != str(shape[axis])
            or (p["strides"] or (1,) * len(shape))[axis] != 1)


@defrule("slice", moves=_slice_moves, window=_slice_window, acts_on=_slice_acts_on)
def _slice(ctx, eqn, invals):
    (x,) = invals
    p = eqn.params
    starts, limits = p["start_indices"], p["limit_indices"]
    strides = p["strides"] or (1,) * x.ndim
    moving = [a for a in range(x.ndim) if is_sym(starts[a])]
    if not moving:
        return None             # constant starts read a logical prefix
    # Slice the constant-start axes; on the others take start(t) + i * stride.
    keep_starts = tuple(0 if a in moving else s for a, s in enumerate(starts))
    keep_limits = tuple(x.shape[a] if a in moving else l for a, l in enumerate(limits))
    keep_strides = tuple(1 if a in moving else s for a, s in enumerate(strides))
    y = lax.slice(x, keep_starts, keep_limits, keep_strides)
    out_shape = eqn.outvars[0].aval.shape
    for a in moving:
        start = ctx.length(starts[a], y.shape)
        if jnp.ndim(start):     # ragged: each row's own start (``x[-1]`` of a row)
            shape = [1] * y.ndim
            shape[a] = out_shape[a]
            y = take_rows(ctx, y, start + strides[a] * iota_along(shape, a), a)
        else:
            y = take_clamped(ctx, y, start + strides[a] * iota_along((out_shape[a],), 0), a)
    return [y]


def _joined_moves(eqn):
    axis = eqn.params["dimension" if eqn.primitive.name == "concatenate" else "axis"]
    avals = [aval for aval in operand_avals(eqn) if not is_empty(aval)]
    if eqn.primitive.name == "concatenate":
        parts = len(avals)
    else:
        parts = sum(1 for size in eqn.params["sizes"] if is_sym(size) or int(size))
    if parts <= 1:
        return []   # joined with (split into) empty pieces only (JAX's edge padding): in place
    return [(aval, (axis,)) for aval in avals]


@defrule("split", moves=_joined_moves, acts_on=acts_along_params)
def _split(ctx, eqn, invals):
    (x,) = invals
    axis, sizes = eqn.params["axis"], eqn.params["sizes"]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    if not any(is_sym(o) for o in offsets):
        return None
    pieces = bind_eqn(eqn, invals)
    for k, (off, size) in enumerate(zip(offsets, sizes)):
        if is_sym(off) and (is_sym(size) or int(size)):     # an empty piece has no values
            start = ctx.length(off, x.shape)
            if jnp.ndim(start):     # ragged: each row's piece from its own offset
                shape = [1] * x.ndim
                shape[axis] = size
                pieces[k] = take_rows(ctx, x, start + iota_along(shape, axis), axis)
            else:
                pieces[k] = take_clamped(ctx, x, start + iota_along((size,), 0), axis)
    return pieces


@defrule("concatenate", moves=_joined_moves, acts_on=acts_along_params)
def _concatenate(ctx, eqn, invals):
    axis = eqn.params["dimension"]
    pieces = [x for x, v in zip(invals, eqn.invars) if not is_empty(v.aval)]
    if len(pieces) == 1:
        return pieces       # the empty pieces add nothing: no offset to move it by
    sizes = [x.shape[axis] for x in invals]
    if not any(is_sym(s) for s in sizes[:-1]):
        return None             # every operand starts at a constant offset
    (joined,) = bind_eqn(eqn, invals)
    # Output position p belongs to operand k when logical_offset_k <= p: read it from
    # p - logical_offset_k + physical_offset_k of the physical concatenation. Ragged: the
    # logical offsets are each row's own.
    n = joined.shape[axis]
    lengths = [ctx.length(size, joined.shape) for size in sizes[:-1]]
    per_row = any(jnp.ndim(v) for v in lengths)
    shape = [1] * joined.ndim
    shape[axis] = n
    pos = iota_along(shape, axis) if per_row else iota_along((n,), 0)
    src = pos
    logical_off, physical_off = 0, 0
    for size, length in zip(sizes[:-1], lengths):
        logical_off = logical_off + length
        physical_off = physical_off + ctx.physical(size)
        src = jnp.where(pos >= logical_off, pos - logical_off + physical_off, src)
    return [take_rows(ctx, joined, src, axis) if per_row else take_clamped(ctx, joined, src, axis)]


def _pad_moves(eqn):
    axes = tuple(a for a, c in enumerate(eqn.params["padding_config"]) if tuple(c) != (0, 0, 0))
    return [(operand_avals(eqn)[0], axes)] if axes else []


def _pad_acts_on(eqn, i, axis, shape):
    return i == 0 and tuple(eqn.params["padding_config"][axis]) != (0, 0, 0)


@defrule("pad", moves=_pad_moves, acts_on=_pad_acts_on)
def _pad(ctx, eqn, invals):
    x, value = invals
    config = eqn.params["padding_config"]
    out_shape = eqn.outvars[0].aval.shape
    general = [a for a, (lo, _, interior) in enumerate(config)
               if is_sym(lo) or (interior and is_sym(x.shape[a]))]
    masked = [a for a, _ in enumerate(config) if a not in general and is_sym(x.shape[a])]
    if not general and not masked:
        return None
    simple = tuple((0, 0, 0) if a in general else c for a, c in enumerate(config))
    y = lax.pad(x, value, simple)
    for a in masked:
        # A constant low padding: the value must also fill from the operand's logical end on.
        lo, _, interior = config[a]
        end = lo + (ctx.length(x.shape[a], y.shape) - 1) * (interior + 1) + 1
        keep = iota_along(y.shape, a) < end
        y = lax.select(keep, y, filled(y.shape, value, y.dtype))
    for a in general:
        lo, _, interior = config[a]
        y = place_window(ctx, y, a, lo, interior, out_shape[a], value)
    return [y]



def _reshape_acts_on(eqn, i, axis, shape):
    # (B, 2, 3) -> (B, 6) keeps each row; (B, 6) -> (6, B) does not.
    p = eqn.params
    return p.get("dimensions") is not None or not keeps_length_axes(shape, p["new_sizes"])


@defrule("reshape", layout=PAD_AND_PACK, acts_on=_reshape_acts_on)
def _reshape(ctx, eqn, invals):
    (x,) = invals
    if eqn.params.get("dimensions") is not None:
        raise NoRule("reshape with a dimensions permutation")
    src, dst = x.shape, eqn.params["new_sizes"]
    if keeps_length_axes(src, dst):
        return None
    ctx.check_relayout(src, dst)
    if _prefix_preserving(src, dst):
        return None
    merged = _ragged_merge(ctx, x, src, dst)
    if merged is not None:
        return [merged]
    # The general case, e.g. (B, T, H) -> (B*T, H): lay the logical elements out row-major.
    # Each output position's logical row-major offset, unravelled over the logical input
    # shape and ravelled over the physical one, is where its value lives.
    flat = lax.reshape(x, (math.prod(src),))
    offset = 0
    for a, d in enumerate(dst):
        offset = offset * ctx.length(d) + iota_along(dst, a)
    pos = 0
    for a in reversed(range(len(src))):
        n = ctx.length(src[a])
        comp = offset % n if a else offset
        offset = offset // n
        stride = math.prod(ctx.physical(d) for d in src[a + 1:]) if a + 1 < len(src) else 1
        pos = pos + comp * stride
    return [take_clamped(ctx, flat, pos.reshape(-1), 0).reshape(dst)]


def _ragged_merge(ctx, x, src, dst):
    """``(..., B, T, ...) -> (..., B*T, ...)`` with T ragged along B: the real elements of
    every row, one row after another (the logical length of ``B*T`` is the sum of the rows'
    lengths). None when the reshape is not that merge."""
    for i in range(len(src) - 1):
        rows = ctx.rows_of(src[i + 1])
        if rows is None or str(src[i]) != rows:
            continue
        j = i
        if (len(dst) != len(src) - 1 or not definitely_equal_shape(src[:i], dst[:j])
                or not definitely_equal_shape(src[i + 2:], dst[j + 1:])
                or not definitely_equal(dst[j], src[i] * src[i + 1])):
            raise NoRule(f"a reshape of {tuple(src)} to {tuple(dst)} other than merging the "
                          f"rows {rows} with their ragged axis")
        lengths = jnp.where(ctx.row_mask(rows), ctx.per_row(src[i + 1]), 0)
        ends = jnp.cumsum(lengths)
        p = iota_along((dst[j],), 0)
        # The row of position p: how many rows end at or before it (searchsorted's default
        # method needs a constant size; B is symbolic).
        b = jnp.sum(p[:, None] >= ends[None, :], axis=1).astype(np.int32)
        t = p - (ends - lengths)[jnp.clip(b, 0, ctx.physical(src[i]) - 1)]
        flat = lax.reshape(x, (*src[:i], src[i] * src[i + 1], *src[i + 2:]))
        return take_clamped(ctx, flat, b * ctx.physical(src[i + 1]) + t, i)
    return None


def _prefix_preserving(src, dst) -> bool:
    """Only unit axes added or removed ((B, T-1, 1) <-> (B, T-1)), or one length axis on each
    side preceded by the same number of constant rows ((T, 4) <-> (4*T,)), after the leading
    axes both keep ((B, T, 2, F) -> (B, 2*T, F): ``jnp.repeat`` along T): either way each
    position keeps its logical block a prefix (a ragged row's own)."""
    if definitely_equal_shape([d for d in src if not _is_unit(d)],
                              [d for d in dst if not _is_unit(d)]):
        return True
    kept = 0
    while (kept < min(len(src), len(dst)) and is_sym(src[kept])
           and same_dim(src[kept], dst[kept])):
        kept += 1       # row-major: a leading axis both sides keep keeps every index on it
    src, dst = src[kept:], dst[kept:]
    s = [a for a, d in enumerate(src) if is_sym(d)]
    d = [a for a, e in enumerate(dst) if is_sym(e)]
    if len(s) != 1 or len(d) != 1:
        return False
    return math.prod(src[:s[0]]) == math.prod(dst[:d[0]])


def keeps_length_axes(src, dst) -> bool:
    """Length axes in the same order, with the same constant block before and between them
    (a head split ``(B, T, 256) -> (B, T, 4, 64)``): each element keeps its coordinates on
    every length axis, so its padding stays padding."""
    def blocks(shape):
        out, run = [], 1
        for d in shape:
            if is_sym(d):
                out.append((run, str(d)))
                run = 1
            else:
                run *= int(d)
        return out
    return blocks(src) == blocks(dst)


def _is_unit(d) -> bool:
    return not is_sym(d) and int(d) == 1


# broadcast_in_dim maps each output position to the operand position with the same index on a
# kept axis (or to a size-1 axis); iota's value at a logical position is the same as at the
# exact size. Their packed rules are below.
defrule("broadcast_in_dim", "iota")(ELEMENTWISE)
deffacts("broadcast_in_dim", fold=lambda x, p: np.broadcast_to(
    np.expand_dims(x, [a for a in range(len(p["shape"]))
                       if a not in p["broadcast_dimensions"]]), p["shape"]),
         linear=True, carries=True)
deffacts("reshape", fold=lambda x, p: x.reshape(p["new_sizes"]), linear=True, carries=True)
deffacts("rev", "slice", "pad", "concatenate", linear=True)


# --------------------------------------------------------------------------------------------
# Packed rows (``layout="pack"``, its per-cell and per-sequence values): the same primitives'
# rules over rows that hold several sequences (`_packed` is the layout's machinery).


@defrule("broadcast_in_dim", layout="per_cell")
def _broadcast_cells(ctx: PackedCtx, eqn, invals):
    """Broadcasting a per-cell value onto the rows gives each cell its own entry."""
    v = invals[0]
    if not ctx.operands[0].per_cell:
        return None
    out = tuple(eqn.outvars[0].aval.shape)
    dims = tuple(eqn.params["broadcast_dimensions"])
    rows = ctx.row_axes(out)
    if not rows:
        return ctx.held_per_cell([lax.broadcast_in_dim(v, (ctx.pos.shape[0], *out),
                                                       (0, *(d + 1 for d in dims)))])
    (r,) = rows
    if r in dims:                   # a unit axis onto the rows: the rows are in front
        v, dims = lax.squeeze(v, (1 + dims.index(r),)), tuple(d for d in dims if d != r)
    return [spread(v, out, (r, *dims))]


@defrule("rev", layout="per_cell")
def _reverse_cells(ctx: PackedCtx, eqn, invals):
    """A reverse of a per-cell value along the packed length is per sequence."""
    x = invals[0]
    if not ctx.operands[0].per_cell:
        return None
    shape = tuple(eqn.invars[0].aval.shape)
    dims = tuple(eqn.params["dimensions"])
    packed = [d for d in dims if d in ctx.packed_axes(shape)]
    if len(packed) != 1 or len(ctx.packed_axes(shape)) != 1:
        raise NoRule("a reverse of a per-cell value along no, or more than one, length")
    return ctx.held_per_cell([reverse_each(ctx, x, 0, packed[0] + 1,
                                           tuple(d + 1 for d in dims if d != packed[0]))])


@defrule("broadcast_in_dim", layout="pack")
def _broadcast_in_dim(ctx: PackedCtx, eqn, invals):
    (x,) = invals[:1]
    shape, dims = eqn.params["shape"], tuple(eqn.params["broadcast_dimensions"])
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    if len(rows) != 1 or len(packed) not in (1, 2):
        return None
    positions = ctx.operands[0].positions
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
    return [by_position(ctx, x, dims, shape, rows[0], along)]


def _unit_axis_at(positions: Callable, k: int) -> Callable:
    """``positions`` of a value whose unit axis ``k`` was squeezed away."""
    return lambda index: positions((*index[:k], np.int32(0), *index[k:]))


def _at_positions(ctx: PackedCtx, positions: Callable, x, dims, shape, rows_axis: int,
                  packed_axes):
    """What `by_position` gathers, recomputed at each cell's positions: ``x`` is made from
    positions alone (`Known.positions`)."""
    index = []
    for k, t in enumerate(dims):
        if t in packed_axes:
            pos, _ = ctx.cells(shape[t])
            index.append(along(jnp.maximum(pos, 0), len(shape), rows_axis, t))
        elif same_dim(x.shape[k], 1):
            index.append(np.int32(0))
        else:
            index.append(lax.broadcasted_iota(np.int32, tuple(
                shape[a] if a == t else 1 for a in range(len(shape))), t))
    return jnp.broadcast_to(positions(tuple(index)), shape).astype(x.dtype)


@defrule("iota", layout="pack")
def _iota_along_packed(ctx: PackedCtx, eqn, invals):
    shape, dim = eqn.params["shape"], eqn.params["dimension"]
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    if len(rows) == 1 and dim == rows[0]:
        # ``jnp.arange(B)`` counts the sequences: each cell's sequence's index in the call
        # (its row in the pad layout). The packed row's own index would be another number.
        if len(packed) > 1:
            raise NoRule("iota along the rows of a value with two packed lengths")
        if not packed:
            index = ctx.sequence_index(ctx.pos.shape[1]).astype(eqn.params["dtype"])
            return ctx.held_per_sequence(
                [spread(index, grid_shape(ctx, shape, dim), (dim, dim + 1))], [dim])
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
def _slice_packed(ctx: PackedCtx, eqn, invals):
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
            if is_sym(start) or start != 0 or stride != 1 or not same_dim(out[a], x.shape[a]):
                raise NoRule("a slice of the rows of packed rows")
        elif (stride == 1 and not is_sym(out[a]) and len(rows) == 1
              and all(b == a or same_dim(out[b], shape[b]) for b in range(len(shape)))):
            # x[:, k:k + m], x[:, T - 1:T] (jnp.pad's edge and reflect modes): m positions of
            # each sequence from its own k (n - 1), a per-sequence value.
            offset = (jnp.full(jnp.shape(ctx.seglen), start, np.int32) if not is_sym(start)
                      else ctx.at_lengths(start, ctx.seglen, as_value=True))
            return ctx.held_per_sequence(
                [_per_sequence_part(ctx, x, shape, rows[0], a, offset, int(out[a]))], rows)
        elif is_sym(start) or stride != 1 or not is_sym(out[a]):
            # x[:, T//2:], x[:, ::2]: where each sequence's part starts or ends.
            raise NoRule("a slice of a packed length that does not keep each sequence's "
                          "start column (a per-sequence start, a stride, a constant size)")
    return None     # column q of the result reads column q + start: the same sequence


@defrule("tile", layout="pack")
def _tile_packed(ctx: PackedCtx, eqn, invals):
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
def _pad_packed(ctx: PackedCtx, eqn, invals):
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
    inside = (pos >= max(lo, 0)) & (pos - lo < ctx.at_lengths(x.shape[a], seglen))
    keep = spread(inside, y.shape, (rows[0], a))
    return [lax.select(keep, y, lax.broadcast_in_dim(fill, y.shape, ()))]


@defrule("concatenate", layout=("pack", "per_sequence"))
def _concatenate_packed(ctx: PackedCtx, eqn, invals):
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
    kept = [i for i, s in enumerate(shapes) if is_sym(s[a]) or s[a] != 0]
    if len(kept) == 1 and len(invals) > 1:
        piece = ctx.operands[kept[0]]
        ctx.results = [piece if piece.per_sequence else None]     # held as that piece is
        return [invals[kept[0]]]
    if a not in ctx.packed_axes(out):
        if any(is_sym(s[a]) for s in shapes):
            raise NoRule("concatenate along the rows of packed rows")
        return None     # along another axis: per position (a per-sequence value: per column)
    return [_joined_per_sequence(ctx, invals, shapes, ctx.operands, out, a)]


def _joined_per_sequence(ctx: PackedCtx, invals, shapes, known, out, a: int):
    """The pieces ``invals`` (logical ``shapes``, annotated ``known``) joined along the
    packed axis ``a`` of ``out`` (`_concatenate_packed`)."""
    frame = ctx.one_frame(out)
    if frame is None:
        raise NoRule("concatenate along a packed length of a value without one rows axis")
    r, _ = frame
    pos, seglen = ctx.cells(out[a])
    column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
    result, offset = None, jnp.zeros_like(pos)
    for x, shape, k in zip(invals, shapes, known):
        if a in ctx.packed_axes(shape):
            # Padded to the output's length first: column ``c - offset`` is then always there.
            grow = out[a] - shape[a]
            if is_sym(grow):
                raise NoRule(f"concatenate of packed lengths {shape[a]} into {out[a]}")
            config = [(0, int(grow) if i == a else 0, 0) for i in range(len(shape))]
            piece = jnp.take_along_axis(lax.pad(x, filled((), 0, x.dtype), config),
                                        along(column - offset, len(out), r, a), axis=a,
                                        mode="clip")
        else:
            held_x, _ = held(ctx, x, shape, k)
            held_x = lax.slice_in_dim(held_x, 0, out[a], axis=r + 1)
            index = jnp.clip(pos - offset, 0, shape[a] - 1)
            at = a + (a > r)
            index = jnp.expand_dims(index, [i for i in range(held_x.ndim) if i not in (r, r + 1)])
            taken = jnp.take_along_axis(held_x, index, axis=at, mode="clip")
            unit = tuple(1 if i == a else d for i, d in enumerate(shape))
            piece = to_cells(ctx, taken, r, unit, out)
        mask = along(pos >= offset, len(out), r, a)
        result = piece if result is None else jnp.where(mask, piece, result)
        offset = offset + (ctx.at_lengths(shape[a], seglen) if is_sym(shape[a]) else shape[a])
    return result


@defrule("concatenate", layout="per_cell")
def _concatenate_cells(ctx: PackedCtx, eqn, invals):
    """Per-cell pieces joined along a packed length without rows (``jnp.linspace(0, 1, T)``
    joins its ``T - 1`` per-cell points and its stop value): each sequence's pieces from its
    own first position, as `_concatenate_packed` joins packed rows -- the per-cell values are
    packed rows with the rows in front (`onto_cells` places the others)."""
    a = eqn.params["dimension"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    if ctx.row_axes(out) or a not in ctx.packed_axes(out) or any(
            k.per_sequence for k in ctx.operands):
        raise NoRule("concatenate of a per-cell value along no packed length, or with rows")
    rows = var_dim(ctx.rows_name, out[a].scope)
    pieces = [onto_cells(ctx, x, s, s, k) for x, s, k in zip(invals, shapes, ctx.operands)]
    pieces = [jnp.broadcast_to(v, (ctx.pos.shape[0], *s)) for v, s in zip(pieces, shapes)]
    return ctx.held_per_cell([_joined_per_sequence(ctx, pieces, [(rows, *s) for s in shapes],
                                                   [PLAIN] * len(pieces), (rows, *out),
                                                   a + 1)])


@defrule("split", layout=("pack", "per_sequence"))
def _split_packed(ctx: PackedCtx, eqn, invals):
    """Along a packed length (a concatenate's transpose), each sequence's parts at its own
    offsets: a part of a packed length holds position ``q`` at column ``start + q``, one of a
    constant length is per sequence (`Known.per_sequence`, held at every cell of it)."""
    (x,) = invals
    a, sizes = eqn.params["axis"], eqn.params["sizes"]
    shape = tuple(eqn.invars[0].aval.shape)
    if sum(is_sym(size) or size != 0 for size in sizes) == 1:
        # One part and empty ones (the transpose of `_concatenate_packed`'s empty pieces): the
        # value, held as it is.
        held_as = ctx.operands[0] if ctx.operands[0].per_sequence else None
        ctx.results = [held_as if is_sym(size) or size != 0 else None for size in sizes]
        return [x if is_sym(size) or size != 0 else filled(v.aval.shape, 0, v.aval.dtype)
                for size, v in zip(sizes, eqn.outvars)]
    if a not in ctx.packed_axes(shape):
        if is_sym(shape[a]):
            raise NoRule("split along the rows of packed rows")
        return None
    frame = ctx.one_frame(shape)
    if frame is None:
        raise NoRule("split along a packed length of a value without one rows axis")
    r, _ = frame
    # The operand with its rows and packed axes first; parts are cut from it by cell.
    moved = jnp.moveaxis(x, (r, a), (0, 1))
    # Per cell: where its sequence's next part starts (the sizes of the parts before it).
    parts, offset, known = [], jnp.zeros_like(ctx.seglen), []
    for size in sizes:
        if is_sym(size):
            pos, _ = ctx.cells(size)
            column = lax.broadcasted_iota(np.int32, jnp.shape(pos), 1)
            index = jnp.expand_dims(column + lax.slice_in_dim(offset, 0, size, axis=1),
                                    list(range(2, moved.ndim)))
            part = jnp.take_along_axis(moved, index, axis=1, mode="clip")
            parts.append(jnp.moveaxis(part, (0, 1), (r, a)))
            known.append(None)
        else:
            parts.append(_per_sequence_part(ctx, x, shape, r, a, offset, size))
            known.append(per_sequence(r, ctx.var))
        offset = offset + (ctx.at_lengths(size, ctx.seglen) if is_sym(size) else size)
    ctx.results = known
    return parts


def _per_sequence_part(ctx: PackedCtx, x, shape, r: int, a: int, offset, size: int):
    """Positions ``offset .. offset + size`` of each sequence (``offset``: per cell of the
    grid) along the packed axis ``a`` of ``x`` (logical ``shape``, rows axis ``r``), held
    per sequence, of ``shape`` with ``size`` along ``a`` -- a constant-size part of a split,
    ``x[:, k:k + m]``. Past the sequence's part of the axis (``x[:, 1:-1]`` of one token, or
    of an axis of ``T + 2`` past position n + 1): zeros, never the next sequence's cells."""
    moved = jnp.moveaxis(x, (r, a), (0, 1))
    at = offset[:, :, None] + lax.broadcasted_iota(np.int32, (1, 1, size), 2)
    n_rows, columns = jnp.shape(ctx.seglen)
    index = jnp.expand_dims((ctx.sequence_starts()[:, :, None] + at).reshape(
        n_rows, columns * size), list(range(2, moved.ndim)))
    taken = jnp.take_along_axis(moved, index, axis=1, mode="clip")
    taken = taken.reshape(n_rows, columns, size, *taken.shape[2:])
    inside = (at >= 0) & (at < ctx.at_lengths(shape[a], ctx.seglen)[:, :, None])
    inside = jnp.expand_dims(inside, list(range(3, taken.ndim)))
    taken = jnp.where(inside, taken, jnp.zeros((), taken.dtype))
    # Axes now (rows, columns, part, *rest); held: the logical order, columns after r.
    rest = [i for i in range(len(shape)) if i not in (r, a)]
    labels = ["r", "columns", "a", *rest]
    order = [i if i not in (r, a) else ("r" if i == r else "a") for i in range(len(shape))]
    order.insert(order.index("r") + 1, "columns")
    return jnp.transpose(taken, [labels.index(k) for k in order])


@defrule("pad", layout="per_sequence")
def _pad_per_sequence(ctx: PackedCtx, eqn, invals):
    """A per-sequence value padded along a constant axis into a packed length (the transpose
    of ``x[:, T - 1:T]``: ``pad(g, (T - 1, 1))``): each sequence's entries at its own
    positions ``lo(n) ..``, the fill around them -- the pieces joined per sequence as
    `_concatenate_packed` joins them. None along any other axis (per column)."""
    x, fill = invals
    shape, out = tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)
    packed = ctx.packed_axes(out)
    config = eqn.params["padding_config"]
    along = [a for a in packed if tuple(config[a]) != (0, 0, 0)]
    x_known, fill_known = ctx.operands
    if not x_known.per_sequence or fill_known.per_sequence or not along:
        return None
    (a,) = along
    lo, hi, interior = config[a]
    if (len(packed) != 1 or is_sym(shape[a]) or interior or x_known.sequence_axis is None
            or any(tuple(c) != (0, 0, 0) for b, c in enumerate(config) if b != a)
            or any(not is_sym(v) and v < 0 for v in (lo, hi))):
        raise NoRule("pad of a per-sequence value into a packed length with other amounts "
                     "than one run of fill before and after it")
    pieces, shapes, known = [], [], []
    for value, length in ((None, lo), (x, shape[a]), (None, hi)):
        piece_shape = tuple(length if b == a else d for b, d in enumerate(shape))
        if not is_sym(length) and length == 0:
            continue
        pieces.append(filled(piece_shape, fill, eqn.outvars[0].aval.dtype) if value is None
                      else value)
        shapes.append(piece_shape)
        known.append(PLAIN if value is None else x_known)
    return [_joined_per_sequence(ctx, pieces, shapes, known, out, a)]


# Per-sequence values of packed rows (``layout="per_sequence"``, `_basics.Known.per_sequence`).


@defrule("broadcast_in_dim", layout="per_sequence")
def _broadcast(ctx, eqn, invals):
    """A per-sequence value broadcast onto rows (a number per sequence) or along a packed
    length (``h[:, None, :]`` to ``(B, T, H)``): each cell its own sequence's entry."""
    (x,), (known,) = invals[:1], ctx.operands[:1]
    shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
    rows, packed = ctx.row_axes(shape), ctx.packed_axes(shape)
    a = known.sequence_axis
    if not known.per_sequence or not (packed or (rows and a is None)):
        return None
    if len(packed) == 1 and packed[0] in dims and a is not None:
        k = dims.index(packed[0])
        if not is_sym(eqn.invars[0].aval.shape[k]) and eqn.invars[0].aval.shape[k] == 1:
            # A unit axis stretched along the length (a ``(B, 1, F)`` mask onto ``(B, T, F)``,
            # dropout shared along T): as if it were not there.
            x, a = lax.squeeze(x, (k + (k > a),)), a - (k < a)
            dims = dims[:k] + dims[k + 1:]
    if len(rows) != 1 or len(packed) > 1 or (packed and packed[0] in dims):
        raise NoRule(f"a per-sequence value broadcast to shape {shape}")
    (r,) = rows
    if a is None:
        if not packed:
            targets = (r, r + 1, *(d + (d > r) for d in dims))
            return ctx.held_per_sequence([spread(x, grid_shape(ctx, shape, r), targets)], [r])
        targets, v = (r, packed[0], *dims), lax.slice_in_dim(x, 0, shape[packed[0]], axis=1)
        return [spread(v, shape, targets)]
    (p,) = packed
    v = lax.slice_in_dim(x, 0, shape[p], axis=a + 1)
    return [spread(v, shape, (*dims[:a + 1], p, *dims[a + 1:]))]


defrule("top_k", layout="per_sequence")(refused)
