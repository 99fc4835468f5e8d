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

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax_internals import definitely_equal, definitely_equal_shape
from ._core import (PAD_AND_PACK, NoRule, acts_along_params, bind_eqn, defrule, filled,
                    iota_along, is_empty, is_sym, operand_avals, place_window, same_dim,
                    take_clamped, take_rows)


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


@defrule("top_k", layout=PAD_AND_PACK)
def _top_k(ctx, eqn, invals):
    (x,) = invals
    axis = eqn.params.get("axis", x.ndim - 1)
    if axis < 0:
        axis += x.ndim
    if not is_sym(x.shape[axis]):
        return None
    if is_sym(eqn.params["k"]):
        raise NoRule("top_k with a symbolic k")
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


