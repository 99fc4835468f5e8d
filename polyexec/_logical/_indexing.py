"""Rules for indexing: ``dynamic_slice``, ``dynamic_update_slice``, ``gather``, ``scatter*``.

Start indices are clamped (or dropped, where XLA drops them: `drops`) against logical bounds,
with room padded at the end where a logical start would not fit physically; scattered rows and
window elements beyond a logical length are dropped, made the combiner's identity, or (plain
scatter, update slice) overwritten back with the operand, so they never land in a logical
position.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util

from ._basics import (bind_eqn_with, filled, has_sym, highest_value, iota_along, is_sym,
                      literal_start, lowest_value, one_position, operand_avals, same_dim)
from ._core import fill_tail, logical_mask, window_fits_admitted_rows
from ._registry import NoRule, deffacts, defrule
from ._families import SCATTERS
from ._packed import PackedCtx, packed_generic, scatter_window
from ._sequences import by_cell, held, refused, spread


def _room(ctx, x, window, axes):
    """``x`` padded at the end by the window's size on ``axes``.

    A start the exact size allows, up to ``n(t) - w(t)``, can exceed the physical room
    ``n - w`` when that room shrinks as the lengths grow (``(20,)`` updated by a ``(T,)``
    window: 20 - t > 20 - T); XLA would then clamp it to the physical room and misplace the
    window. With ``w`` more positions at the end, every logical start fits physically.
    """
    if not axes:
        return x
    config = [(0, window[a] if a in axes else 0, 0) for a in range(x.ndim)]
    return lax.pad(x, np.zeros((), x.dtype), config)


def _unroom(x, shape):
    return x if tuple(x.shape) == tuple(shape) else lax.slice(x, (0,) * x.ndim, tuple(shape))


def _clamped_starts(ctx, operand_shape, window_shape, starts):
    """Start indices clamped to the logical bounds on length axes, as at the exact size, and
    the axes that need `_room`."""
    out, room = list(starts), []
    for a, (n, w) in enumerate(zip(operand_shape, window_shape)):
        if isinstance(starts[a], (int, np.integer, np.ndarray)) and int(starts[a]) == 0:
            continue            # a literal 0 is clamped to 0 at every size
        if is_sym(n) or is_sym(w):
            if not ctx.recorder.monotone(n - w):
                room.append(a)
            start = jnp.asarray(starts[a])
            # One difference, not two lengths: ``T - (T - 1)`` is 1 in every row, ragged or not.
            out[a] = jnp.clip(start, 0, ctx.length(n - w)).astype(start.dtype)
    return out, room


def _dynamic_slice_moves(eqn):
    aval = operand_avals(eqn)[0]
    axes = tuple(a for a in range(len(aval.shape))
                 if not same_dim(eqn.params["slice_sizes"][a], aval.shape[a]))
    return [(aval, axes)] if axes else []


def _dynamic_window(eqn, invals):
    """A dynamic slice's (or update's) window from each start: the start an int when it is a
    constant, else None (traced)."""
    first, window = ((1, eqn.params["slice_sizes"]) if eqn.primitive.name == "dynamic_slice"
                     else (2, invals[1].shape))
    return [(a, int(st) if isinstance(st, (int, np.integer, np.ndarray)) and np.ndim(st) == 0
             else None, window[a]) for a, st in enumerate(invals[first:])]


@defrule("dynamic_slice", moves=_dynamic_slice_moves, window=_dynamic_window)
def _dynamic_slice(ctx, eqn, invals):
    x, *starts = invals
    sizes = eqn.params["slice_sizes"]
    if not any(is_sym(n) or is_sym(w) for n, w in zip(x.shape, sizes)):
        return None
    starts, room = _clamped_starts(ctx, x.shape, sizes, starts)
    return bind_eqn_with(eqn, [_room(ctx, x, sizes, room), *starts])


@defrule("dynamic_update_slice", window=_dynamic_window)
def _dynamic_update_slice(ctx, eqn, invals):
    x, update, *starts = invals
    if not has_sym(x.shape) and not has_sym(update.shape):
        return None
    starts, room = _clamped_starts(ctx, x.shape, update.shape, starts)
    roomy = _room(ctx, x, update.shape, room)
    (out,) = bind_eqn_with(eqn, [roomy, update, *starts])
    # The update's tail was written too: where it landed, keep the operand.
    spill = None
    for a, w in enumerate(update.shape):
        if is_sym(w):
            # Ragged rows: each row's update length (a start is one for every row).
            s = (iota_along(roomy.shape, a)
                 >= jnp.asarray(starts[a], np.int32) + ctx.length(w, roomy.shape))
            spill = s if spill is None else lax.bitwise_or(spill, s)
    if spill is not None:
        out = lax.select(spill, roomy, out)
    return [_unroom(out, x.shape)]


def _index_bounds(ctx, operand_shape, window, index_map, idx, params, batching=((), ())):
    """Per index component: the largest start that keeps the window inside the logical
    operand, or None where the operand axis is not a length axis or the program fixed the
    index at 0 (``x[:, :1]``: clamped, 0 stays 0 at every size, ragged rows included); the
    operand axes that need `_room`. A bound may be per index entry, at the length of the row
    it reads (`_row_bounds`); ``batching``: the equation's operand and index batching
    dimensions."""
    if (isinstance(idx, np.ndarray) and not idx.any()
            and params["mode"] != lax.GatherScatterMode.FILL_OR_DROP):
        return [None] * len(index_map), []
    bounds, room = [], []
    for i, a in enumerate(index_map):
        n, w, start = operand_shape[a], window[a], literal_start(idx, i)
        if start is not None and not one_position(w) and window_fits_admitted_rows(
                ctx, n, w, start):
            bounds.append(None)     # ``r[1:3]``: every row it may run on holds the window
        elif is_sym(n) or is_sym(w):
            if not ctx.recorder.monotone(n - w):
                room.append(a)
            try:
                bounds.append(ctx.length(n - w))   # per row it may differ; the difference may not
            except NoRule:
                per_row = _row_bounds(ctx, n - w, operand_shape, window, index_map, idx, batching)
                if per_row is None:
                    raise
                bounds.append(per_row)
        else:
            bounds.append(None)
    return bounds, room


def _row_bounds(ctx, d, operand_shape, window, index_map, idx, batching):
    """The bound ``d`` (a length ragged along rows, minus the window) of each index entry, at
    the length of the row that entry reads, when the equation pairs each entry with one row: a batching dimension over the rows
    (``take_along_axis(h, (lengths - 1)[:, None, None], 1)``), or an index component picking
    one row (``h[jnp.arange(B), lengths - 1]``, ``h[rows, positions]``), whose index is
    clamped into the real rows first, as at the exact size. Never below 0: a row of length 0
    has no position, and an index clamped into it reads position 0 -- the caller's own
    padding there, as ``jax.jit`` on the exact-size batch reads it (one FILL_OR_DROP finds
    outside, ``-1``, gives the fill). Shaped to broadcast against one index component; None
    for any other equation."""
    rows = ctx.rows_of(d)
    axes = ctx.row_axes(operand_shape, rows) if rows is not None else []
    if len(axes) != 1:
        return None
    (r,) = axes
    per_row = ctx.per_row(d)                # (rows,), never below 0
    operand_batching, index_batching = (tuple(b) for b in batching)
    if r in operand_batching:
        shape = [1] * (jnp.ndim(idx) - 1)
        shape[index_batching[operand_batching.index(r)]] = -1
        return jnp.reshape(per_row, shape)
    if r in index_map and one_position(window[r]):
        row = jnp.clip(jnp.asarray(idx)[..., list(index_map).index(r)], 0,
                       ctx.length(operand_shape[r] - 1))
        return jnp.take(per_row, row, mode="clip")
    return None


def _gather_moves(eqn):
    aval, p = operand_avals(eqn)[0], eqn.params
    dn = p["dimension_numbers"]
    shape, sizes = aval.shape, p["slice_sizes"]
    # One position of every other length axis, each indexed: a picked row keeps no length
    # (``h[jnp.arange(B), lengths - 1]``); the rule bounds each position by its row's own.
    points = lambda a: all(b == a or b in dn.operand_batching_dims or not is_sym(shape[b])  # noqa: E731
                           or (b in dn.start_index_map and one_position(sizes[b]))
                           for b in range(len(shape)))
    axes = tuple(a for a in range(len(shape)) if a not in dn.operand_batching_dims
                 and (a in dn.start_index_map or not same_dim(sizes[a], shape[a]))
                 and not (a in dn.start_index_map and one_position(sizes[a]) and points(a)))
    return [(aval, axes)] if axes else []


def _gather_window(eqn, invals):
    p = eqn.params
    return [(a, literal_start(invals[1], i), p["slice_sizes"][a])
            for i, a in enumerate(p["dimension_numbers"].start_index_map)]


def _gather_acts_on(eqn, i, axis, shape):
    p = eqn.params
    dn = p["dimension_numbers"]
    if i == 0:
        return not (axis in dn.operand_batching_dims or (
            axis not in dn.collapsed_slice_dims and axis not in dn.start_index_map
            and str(p["slice_sizes"][axis]) == str(shape[axis])))
    return axis == len(shape) - 1


def drops(eqn, *, sliced: bool = False) -> bool:
    """Whether ``eqn`` (a gather or a scatter) drops an index outside its bounds, as
    ``jax.jit`` at the exact size does -- a gather fills there, a scatter skips the update --
    rather than clamping it: FILL_OR_DROP; and a scatter in PROMISE_IN_BOUNDS mode, whose
    out-of-bounds updates XLA skips (it clamps a gather's index), except the gradient of a
    ``sliced`` read: one position of an axis for every row, ``x[:, k]``, which jnp reads with
    a gather only over a symbolic length -- at an exact size it takes a (dynamic) slice, which
    clamps the start for the read and its gradient alike. That gradient is the scatter-add
    JAX's autodiff writes as the gather's transpose; ``x.at[:, k].set(v, mode=...)`` is a
    scatter at every size, and drops."""
    mode = eqn.params["mode"]
    return mode == lax.GatherScatterMode.FILL_OR_DROP or (
        mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS and eqn.primitive.name != "gather"
        and not (sliced and _transposes_a_read(eqn)))


def _transposes_a_read(eqn) -> bool:
    """Whether ``eqn`` is the scatter-add autodiff makes of jnp's read at a static index:
    the name stack the interpreter evaluates it under (`_core.eval_jaxpr`: its programs'
    and its own, a backward loop's body included) is a transpose's, as ``jax.grad`` writes
    it, and it keeps the sorted, unique indices jnp declares for such a read. The gathers
    JAX's own rules write (the JVP of ``x.at[:, k].min(v)``) declare neither, and stay
    gathers at an exact size: their transposes drop."""
    p = eqn.params
    return (eqn.primitive.name == "scatter-add" and p["indices_are_sorted"]
            and p["unique_indices"]
            and "transpose(" in str(source_info_util.current_name_stack()))


def within(eqn, position, n, *, sliced: bool = False):
    """``(position, inside)``: an index into ``n`` positions (a row's, a sequence's) as the
    gather or scatter ``eqn`` reads it (``sliced``: see `drops`). One that `drops` keeps it,
    inside where it falls in ``[0, n)``; any other clamps it there, inside unless there is no
    position at all (``n == 0``: a row or sequence of length 0)."""
    if drops(eqn, sliced=sliced):
        return position, (position >= 0) & (position < n)
    return jnp.clip(position, 0, jnp.maximum(n - 1, 0)), n > 0


def _held_index(per_row):
    """A gather (scatter) whose index is held per row (`Known.per_row`) reads (writes) each row
    at its own position when it has the one-position form (`_per_row_position`,
    `_per_row_put`) -- rather than running once per row over the whole operand, B times
    the work; None for any other, which does run per row (`_eval_row_varying`)."""
    def held(ctx, eqn, invals):
        x, idx, *rest = invals
        if ctx.operands[0].per_row or not ctx.operands[1].per_row or any(
                k.per_row for k in ctx.operands[2:]):
            return None
        return per_row(ctx, eqn, x, idx, *rest)
    return held


@defrule("gather", moves=_gather_moves, window=_gather_window, acts_on=_gather_acts_on)
def _gather(ctx, eqn, invals):
    x, idx = invals
    p = eqn.params
    dn = p["dimension_numbers"]
    try:
        bounds, room = _index_bounds(
            ctx, x.shape, p["slice_sizes"], dn.start_index_map, idx, p,
            (dn.operand_batching_dims, dn.start_indices_batching_dims))
    except NoRule:
        picked = _per_row_position(ctx, eqn, x, idx)
        if picked is None:
            raise
        return picked
    if all(b is None for b in bounds):
        return None             # only the indices' batch axes are lengths: per position
    x = _room(ctx, x, p["slice_sizes"], room)
    comps, oob = _bounded_indices(idx, bounds, check=drops(eqn), clamp=True)
    idx = jnp.stack(comps, axis=-1) if comps else idx
    (out,) = bind_eqn_with(eqn, [x, idx])
    if oob is not None:
        # Out of the logical bounds: the fill value, as at the exact size.
        batch_dims = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
        mask = lax.broadcast_in_dim(oob, out.shape, batch_dims)
        out = lax.select(mask, filled(out.shape, gather_fill(p, out.dtype), out.dtype), out)
    return [out]


def gather_fill(p, dtype):
    """A gather's value outside its bounds: ``fill_value``, else lax.gather's own."""
    if p["fill_value"] is not None:
        return p["fill_value"]
    return np.nan if jnp.issubdtype(dtype, jnp.inexact) else highest_value(dtype) \
        if jnp.issubdtype(dtype, jnp.unsignedinteger) or dtype == np.bool_ else lowest_value(dtype)


def _one_position_axis(ctx, x_shape, window, index_map, dropped, out_axes, batching):
    """The length axis ``t`` a gather reads (a scatter writes) one position of, with every
    other axis whole -- ``x[:, k]``, and ``r[i]`` of ``jax.vmap``, whose index also names the
    whole feature axes at 0 --, and the component of the index that holds ``k``; None for
    any other form. ``dropped``: the axes the result has not (collapsed, inserted);
    ``out_axes``: where the others lie in the result (the update), which must be in order."""
    if batching or not set(dropped) <= set(index_map):
        return None
    picked = [a for a in index_map if not same_dim(window[a], x_shape[a])]
    if len(picked) != 1 or not (set(dropped) <= set(picked)):
        return None
    (t,) = picked
    kept = [a for a in range(len(x_shape)) if a not in dropped]
    if (not one_position(window[t]) or ctx.rows_of(x_shape[t]) is None
            or tuple(out_axes) != tuple(range(len(kept)))):
        return None
    return t, list(index_map).index(t)


def _one_index(ctx, idx) -> bool:
    """Whether ``idx`` (the operand 1 of a gather or scatter) is one index vector: for all
    rows, or one per row (held per row with the rows in front)."""
    return jnp.ndim(idx) == 1 + bool(ctx.operands[1].per_row)


def _position_per_row(ctx, eqn, x, t, idx, component):
    """The position each row reads along ``t``, shaped to broadcast along ``x``: one index
    for all rows, or each row's own (held per row, `Known.per_row`: ``x[:, t]`` inside a scan
    over ``jnp.arange(x.shape[1])``, which JAX normalises by ``x.shape[1]``, each row's
    length); and where, if the equation `drops`, the other components (starts of whole axes,
    which fit only at 0) put the window out of bounds (None: nowhere)."""
    rows = ctx.operands[1].per_row              # the index is operand 1
    if rows:
        (axis,) = ctx.row_axes(x.shape, rows)
        one = tuple(d if a == axis else 1 for a, d in enumerate(x.shape))
        idx = lax.broadcast_in_dim(idx, (*one, idx.shape[-1]), (axis, x.ndim))
    k, others = idx[..., component], None
    if drops(eqn, sliced=True):
        for c in range(idx.shape[-1]):
            if c != component:
                bad = idx[..., c] != 0
                others = bad if others is None else others | bad
    return k, others


def _per_row_position(ctx, eqn, x, idx):
    """``x[:, k]`` of a ``(B, T, ...)`` value whose ``T`` differs per row: each row's own
    position ``k``, clamped into its own length as at its exact size (the gather's fill
    outside it where the gather `drops`, and in a row of length 0, which has no position); None
    for any other gather. ``k`` may differ per row (`_position_per_row`)."""
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    if not _one_index(ctx, idx):
        return None
    found = _one_position_axis(ctx, x.shape, p["slice_sizes"], dn.start_index_map,
                               dn.collapsed_slice_dims, dn.offset_dims, dn.operand_batching_dims)
    if found is None:
        return None
    t, component = found
    n = ctx.length(x.shape[t], shape=x.shape)       # per row, shaped to broadcast along x
    k, others = _position_per_row(ctx, eqn, x, t, idx, component)
    one = tuple(1 if a == t else d for a, d in enumerate(x.shape))
    k, inside = within(eqn, k, n, sliced=True)
    position = jnp.broadcast_to(k.astype(np.int32), one)
    out = jnp.take_along_axis(x, position, axis=t, mode="clip")
    outside = ~inside if others is None else ~inside | others
    outside = jnp.broadcast_to(outside, one)
    out = lax.select(outside, filled(out.shape, gather_fill(p, out.dtype), out.dtype), out)
    return [lax.squeeze(out, (t,)) if t in dn.collapsed_slice_dims else out]


def _per_row_put(ctx, eqn, x, idx, updates):
    """The transpose of `_per_row_position` (``x.at[:, k].add(u)``, ``.set``): each row's
    update into its own position ``k`` (clamped into its length, or dropped outside it where
    the scatter `drops`, and in a row of length 0); None for any other scatter."""
    dn = eqn.params["dimension_numbers"]
    if eqn.primitive.name not in SCATTERS or not _one_index(ctx, idx):
        return None
    window = [1] * x.ndim
    for a, u in zip([a for a in range(x.ndim) if a not in dn.inserted_window_dims],
                    dn.update_window_dims):
        window[a] = updates.shape[u]
    found = _one_position_axis(ctx, x.shape, window, dn.scatter_dims_to_operand_dims,
                               dn.inserted_window_dims, dn.update_window_dims,
                               dn.operand_batching_dims)
    if found is None:
        return None
    t, component = found
    n = ctx.length(x.shape[t], shape=x.shape)
    k, others = _position_per_row(ctx, eqn, x, t, idx, component)
    k, inside = within(eqn, k, n, sliced=True)
    drop = ~inside if others is None else ~inside | others
    at = (iota_along(x.shape, t) == k) & ~drop
    if t not in dn.inserted_window_dims:
        updates = lax.squeeze(updates, (t,))
    spread = lax.broadcast_in_dim(updates, x.shape, tuple(a for a in range(x.ndim) if a != t))
    return [_written(eqn, x, at, spread)]


def _written(eqn, x, at, update):
    """``x`` after the scatter ``eqn`` writes ``update`` where ``at`` holds, once a position
    (as a one-position index writes): its family's combiner of the old value and the update
    (`SCATTERS`); a plain ``scatter`` leaves the update. A scatter-add adds zeros elsewhere
    rather than selecting ``x``, so a zeroed tail of ``x`` stays known as zeroed."""
    if eqn.primitive.name == "scatter-add":
        return x + lax.select(at, update, filled(x.shape, 0, x.dtype))
    family = SCATTERS[eqn.primitive.name]
    return lax.select(at, update if family is None else family.combine(x, update), x)


def _bounded_indices(idx, bounds, *, check: bool, clamp: bool):
    """The index components of ``idx`` (its last axis) against their logical upper bounds
    (None: unbounded): each clamped into ``[0, b]`` with ``clamp``; with ``check``, also where
    any component falls outside (None when nothing is checked)."""
    comps, outside = [], None
    for k, b in enumerate(bounds):
        c = idx[..., k]
        if b is not None:
            if check:
                bad = (c < 0) | (c > b)
                outside = bad if outside is None else outside | bad
            if clamp:
                c = jnp.clip(c, 0, b).astype(c.dtype)
        comps.append(c)
    return comps, outside


def _scatter_acts_on(eqn, i, axis, shape):
    # Per sequence only where each row scatters into its own row: batched over the rows, or
    # the rows a whole window axis of the update (``x.at[:, 0].add(u)``, the gradient of
    # ``x[:, 0]``).
    dn = eqn.params["dimension_numbers"]
    operand = eqn.invars[0].aval.shape
    rows = [a for a, d in enumerate(operand) if str(d) == str(shape[axis])]
    if (i == 1 and axis == len(shape) - 1) or len(rows) != 1:
        return True
    (a,) = rows
    window_axes = [b for b in range(len(operand))
                   if b not in dn.inserted_window_dims and b not in dn.operand_batching_dims]
    if a in window_axes and a not in dn.scatter_dims_to_operand_dims:
        u = dn.update_window_dims[window_axes.index(a)]
        return str(eqn.invars[2].aval.shape[u]) != str(operand[a])
    return a not in dn.operand_batching_dims


def _scatter_window(eqn, invals):
    """A scatter's update windows along the axes it indexes, from a start taken as traced:
    ``jax.jit`` refuses an update window longer than its axis (``jax.vmap`` of
    ``dynamic_update_slice``), but drops or clamps one that starts too late by its mode."""
    dn = eqn.params["dimension_numbers"]
    operand, updates = eqn.invars[0].aval.shape, eqn.invars[2].aval.shape
    window_axes = [a for a in range(len(operand))
                   if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
    sizes = {a: updates[u] for a, u in zip(window_axes, dn.update_window_dims)}
    return [(a, None, sizes[a]) for a in dn.scatter_dims_to_operand_dims if a in sizes]


@defrule("scatter", "scatter-add", acts_on=_scatter_acts_on, window=_scatter_window)
@defrule(*(name for name in SCATTERS if name not in ("scatter", "scatter-add")),
         window=_scatter_window)
def _scatter(ctx, eqn, invals):
    x, idx, updates = invals
    p = eqn.params
    dn = p["dimension_numbers"]
    name = eqn.primitive.name
    window_axes = [a for a in range(x.ndim)
                   if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
    window = [1] * x.ndim
    for a, u in zip(window_axes, dn.update_window_dims):
        window[a] = updates.shape[u]
    scatter_dims = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
    try:
        bounds, room = _index_bounds(
            ctx, x.shape, window, dn.scatter_dims_to_operand_dims, idx, p,
            (dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    except NoRule:
        put = _per_row_put(ctx, eqn, x, idx, updates)
        if put is None:
            raise
        return put
    rows = [j for j, d in enumerate(scatter_dims) if is_sym(updates.shape[d])]
    window_tail = [u for u in dn.update_window_dims if is_sym(updates.shape[u])]
    if all(b is None for b in bounds) and not rows and not window_tail:
        return None
    if window_tail:
        if SCATTERS[name] is not None:
            # Window elements beyond the logical length add the combiner's identity.
            updates = fill_tail(ctx, updates, window_tail,
                                SCATTERS[name].identity(updates.dtype), known=ctx.operands[2])
        elif name != "scatter":
            raise NoRule(f"{name} with a window of a length")
    if not dn.scatter_dims_to_operand_dims:
        if rows or (window_tail and name == "scatter"):
            raise NoRule("a scatter without indices whose rows or windows are lengths")
        return bind_eqn_with(eqn, [x, idx, updates])
    # Clamp (CLIP) or drop (`drops`) against the logical bounds, then drop rows beyond the
    # updates' logical lengths by sending them out of bounds.
    drop_mode = drops(eqn)
    big = np.array(jnp.iinfo(idx.dtype).max, idx.dtype)
    comps, drop = _bounded_indices(idx, bounds, check=drop_mode, clamp=not drop_mode)
    batch_shape = idx.shape[:-1]
    for j in rows:
        bad = iota_along(batch_shape, j) >= ctx.length(batch_shape[j], batch_shape)
        drop = bad if drop is None else drop | bad
    if drop is not None:
        comps[0] = jnp.where(drop, big, comps[0]).astype(idx.dtype)
    idx = jnp.stack(comps, axis=-1)
    roomy = _room(ctx, x, window, room)
    drop_mode = lax.GatherScatterMode.FILL_OR_DROP
    (out,) = bind_eqn_with(eqn, [roomy, idx, updates], mode=drop_mode)
    if window_tail and name == "scatter":
        # A plain scatter writes its windows' tails too. Scatter "written by a logical window
        # element" alongside, and keep the operand wherever only tails landed.
        marks = lax.convert_element_type(logical_mask(ctx, updates.shape, window_tail), np.int32)
        written = lax.scatter_add(lax.full(roomy.shape, 0, np.int32), idx, marks, dn,
                                  indices_are_sorted=p["indices_are_sorted"],
                                  unique_indices=p["unique_indices"], mode=drop_mode)
        out = lax.select(written > 0, out, roomy)
    return [_unroom(out, x.shape)]


deffacts("gather", row_varying=_held_index(_per_row_position))
deffacts(*SCATTERS, row_varying=_held_index(_per_row_put))
# An embedding's gradient: rows of updates added into the table.
deffacts("scatter-add", sums_rows=lambda eqn, row_axes: bool(row_axes(eqn.invars[2].aval.shape)))

# --------------------------------------------------------------------------------------------
# Packed rows (``layout="pack"``, its per-cell and per-sequence values): the same primitives'
# rules over rows that hold several sequences (`_packed` is the layout's machinery).


def _position(ctx: PackedCtx, eqn, shape, index, index_map, window):
    """Where ``x[:, k]`` reads (or its transpose writes) along the packed axis of ``shape``,
    when the equation takes one position of it and every entry of the other axes (``r[k]``
    under ``jax.vmap`` too, which indexes the features at 0): ``(p, position, inside)``, the
    position per grid cell (``k``, or ``n - 1`` for ``x[:, -1]``, whose ``T - 1`` is a number
    per sequence) and whether it is inside the sequence's part of the axis; None for any
    other indexing."""
    frame, k = ctx.one_frame(shape), len(index_map)
    if (frame is None or tuple(eqn.invars[1].aval.shape) != (k,)
            or frame[1] not in index_map or window[frame[1]] != 1
            or (ctx.operands[1].per_sequence and ctx.operands[1].sequence_axis is not None)
            or any(a != frame[1] and not same_dim(window[a], shape[a])
                   for a in range(len(shape)))
            or (k > 1 and drops(eqn, sliced=True))):
        return None
    _, p = frame
    i = list(index_map).index(p)
    if ctx.operands[1].per_sequence:
        position = index[..., i]
    else:
        position = jnp.broadcast_to(jnp.asarray(index)[i], ctx.pos.shape)
    position, inside = within(eqn, position, ctx.at_lengths(shape[p], ctx.seglen), sliced=True)
    return p, position.astype(np.int32), inside


def _own_position(ctx: PackedCtx, eqn, shape, index, index_map, window, batching,
                  index_shape):
    """Where ``take_along_axis(x, (lengths - 1)[:, None, None], 1)`` reads (or its transpose
    writes) along the packed axis of ``shape``: an equation batched over the rows (each
    sequence's entry with its own index) that takes one position of the packed axis and every
    entry of the others, its index a number per sequence. ``(r, p, s, position, inside)``:
    the rows and packed axes, the index's rows axis, the position per grid cell and whether
    it is inside the sequence's part of the axis; None for any other indexing."""
    frame = ctx.one_frame(shape)
    operand_batching, index_batching = (tuple(b) for b in batching)
    if frame is None or operand_batching != frame[:1]:
        return None
    r, p = frame
    (s,) = index_batching
    if (ctx.row_axes(index_shape) != [s] or tuple(index_map) != (p,) or window[p] != 1
            or any(a not in (r, p) and not same_dim(window[a], shape[a])
                   for a in range(len(shape)))
            or any(is_sym(d) or d != 1 for a, d in enumerate(index_shape) if a != s)):
        return None
    if not (ctx.operands[1].per_sequence or hasattr(index, "shape")):
        return None
    index, axis = held(ctx, index, index_shape, ctx.operands[1])
    if axis != s:
        return None
    position = jnp.reshape(jnp.moveaxis(index, (s, s + 1), (0, 1)), ctx.pos.shape)
    position, inside = within(eqn, position, ctx.at_lengths(shape[p], ctx.seglen))
    return r, p, s, position.astype(np.int32), inside


def _pick_own(ctx: PackedCtx, eqn, invals):
    """``take_along_axis(x, (lengths - 1)[:, None, None], 1)`` of a packed value (the gather
    batched over the rows): each sequence's own position, a per-sequence value; outside the
    sequence (and in a sequence of length 0, which has no cell), the gather's fill."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if ctx.operands[0].per_sequence else _own_position(
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
    return ctx.held_per_sequence([jnp.moveaxis(picked, tuple(range(len(dest))), dest)], [r_out])


def _put_own(ctx: PackedCtx, eqn, invals):
    """The transpose of `_pick_own`: each sequence's update added into (or set at) its own
    position; nothing where that is outside the sequence."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    update_shape = eqn.invars[2].aval.shape
    if ctx.operands[0].per_sequence or eqn.primitive.name not in SCATTERS:
        return None
    window = scatter_window(eqn)
    found = _own_position(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
                          (dn.operand_batching_dims, dn.scatter_indices_batching_dims),
                          eqn.invars[1].aval.shape)
    if found is None or not set(dn.inserted_window_dims) <= {found[1]}:
        return None
    r, p, s, position, inside = found
    scattered = [d for d in range(len(update_shape)) if d not in dn.update_window_dims]
    r_upd = scattered[s]
    if ctx.operands[2].per_sequence and ctx.operands[2].sequence_axis != r_upd:
        return None
    updates, _ = held(ctx, updates, update_shape, ctx.operands[2])
    u = jnp.moveaxis(updates, (r_upd, r_upd + 1), (0, 1))
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


def _put_ranked(ctx: PackedCtx, eqn, invals):
    """``top_k``'s gradient: the scatter-add of each sequence's ``k`` updates at its ``k``
    positions (`_top_per_sequence` holds both at every cell of the sequence), into a
    ``(rows, packed length)`` operand: rank by rank, as one position per sequence is written
    back (`_write_at_positions`), so nothing crosses a sequence or lands outside the frame."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    index_shape = eqn.invars[1].aval.shape
    if (eqn.primitive.name != "scatter-add" or ctx.operands[0].per_sequence
            or not ctx.operands[1].per_sequence or ctx.operands[1].sequence_axis != 0
            or len(shape) != 2
            or ctx.row_axes(shape) != [0] or ctx.packed_axes(shape) != [1]
            or (tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims),
                tuple(dn.scatter_dims_to_operand_dims), tuple(dn.inserted_window_dims),
                tuple(dn.update_window_dims)) != ((0,), (0,), (1,), (1,), ())
            or len(index_shape) != 3 or is_sym(index_shape[1]) or index_shape[2] != 1):
        return None
    value, _ = held(ctx, updates, eqn.invars[2].aval.shape, ctx.operands[2])  # (rows, columns, k)
    for j in range(index_shape[1]):             # each rank's update, as one position's
        cells = lax.slice_in_dim(value[:, :, j], 0, shape[1], axis=1)
        (x,) = _write_at_positions(ctx, eqn, x, cells, index[:, :, j, 0], ctx.pos >= 0,
                                   0, 1)
    return [x]


def _write_at_positions(ctx: PackedCtx, eqn, x, cells, position, inside, r: int, p: int):
    """``x`` with each sequence's cell at ``position`` (per cell, where ``inside``) set to
    ``cells`` there (``scatter``), added to (``scatter-add``), or combined as the scatter
    does (`_written`): the write-back of a packed per-sequence index, the transpose of reading
    one."""
    shape = eqn.invars[0].aval.shape
    n = shape[p]
    pos, _ = ctx.cells(n)
    at = (pos == lax.slice_in_dim(position, 0, n, axis=1)) & lax.slice_in_dim(inside, 0, n, axis=1)
    at = spread(at & ctx.in_frame(n), shape, (r, p))
    return [_written(eqn, x, at, cells)]


def _pick(ctx: PackedCtx, eqn, invals):
    """``x[:, k]`` and ``x[:, -1]`` of a packed value (and ``r[k]`` under ``jax.vmap``): each
    sequence's own position ``k`` (``n - 1``), a per-sequence value; outside the sequence, as
    the gather's mode says."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if ctx.operands[0].per_sequence else _position(
        ctx, eqn, shape, index, dn.start_index_map, eqn.params["slice_sizes"])
    if found is None:
        return None
    p, position, inside = found
    kept = len(shape) - len(dn.collapsed_slice_dims)
    if (not set(dn.collapsed_slice_dims) <= {p} or dn.operand_batching_dims
            or tuple(dn.offset_dims) != tuple(range(kept))):
        return None
    (r,) = ctx.row_axes(shape)
    n = ctx.at_lengths(shape[p], ctx.seglen)
    column = ctx.sequence_starts() + jnp.clip(position, 0, jnp.maximum(n - 1, 0))
    xs = jnp.moveaxis(x, (r, p), (0, 1))
    picked = jnp.take_along_axis(xs, jnp.expand_dims(column, tuple(range(2, xs.ndim))), axis=1,
                                 mode="clip")
    # Outside the sequence the gather's fill (a sequence of length 0 has no position to clamp
    # to, whatever the mode: `within`).
    keep = jnp.expand_dims(inside, tuple(range(2, xs.ndim)))
    picked = jnp.where(keep, picked, jnp.asarray(gather_fill(eqn.params, x.dtype), x.dtype))
    if p not in dn.collapsed_slice_dims:            # the position's unit axis stays
        picked = jnp.expand_dims(picked, 2 + p - (r < p))
    (r_out,) = ctx.row_axes(eqn.outvars[0].aval.shape)
    return ctx.held_per_sequence([by_cell(picked, r_out)], [r_out])


def _put(ctx: PackedCtx, eqn, invals):
    """The transpose of `_pick` (``x.at[:, -1].add(g)``, ``.set``): each sequence's update
    into its own position ``k`` (``n - 1``); nothing where that is outside the sequence."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    update_shape = eqn.invars[2].aval.shape
    kept = len(shape) - len(dn.inserted_window_dims)
    if (ctx.operands[0].per_sequence or eqn.primitive.name not in SCATTERS
            or dn.operand_batching_dims or tuple(dn.update_window_dims) != tuple(range(kept))):
        return None
    window = list(update_shape)
    for a in sorted(dn.inserted_window_dims):
        window.insert(a, 1)
    found = _position(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window)
    if found is None or not set(dn.inserted_window_dims) <= {found[0]}:
        return None
    p, position, inside = found
    if (ctx.operands[2].per_sequence and ctx.operands[2].sequence_axis is None
            or not ctx.row_axes(update_shape)):
        raise NoRule("a scatter into one position of a packed length from a value without rows")
    value, _ = held(ctx, updates, update_shape, ctx.operands[2])
    (r,) = ctx.row_axes(shape)
    if p not in dn.inserted_window_dims:            # the position's unit axis: squeezed
        value = lax.squeeze(value, (p + (p > r),))
    n = shape[p]
    # The update's axes in the operand's, the columns taking the place of the packed axis.
    targets = [a for a in range(len(shape)) if a != p]
    targets.insert(targets.index(r) + 1, p)
    cells = spread(lax.slice_in_dim(value, 0, n, axis=targets.index(p)), shape, targets)
    return _write_at_positions(ctx, eqn, x, cells, position, inside, r, p)


def _sequence_and_position(ctx: PackedCtx, eqn, shape, index, index_map, window, batching,
                           index_shape):
    """Where ``h[jnp.arange(B), lengths - 1]`` (``h[rows, positions]``) reads, or its
    transpose writes: an equation whose index, one pair per sequence (a per-sequence value of
    shape ``(B, 2)``), picks a row of the logical batch -- a sequence -- and a position of
    the packed axis, and every entry of the other axes. As in the pad layout, the row is
    clamped into the real sequences and the position into that sequence's own part of the
    axis (the gather's fill, or a dropped update, outside them where the equation `drops`,
    and in a sequence of length 0, which has no cell). ``(r, p, row, column, inside)``: the
    operand's rows and packed axes, and per grid cell (its sequence's pair) the packed row
    and column read, and whether they hold that position; None for any other indexing."""
    frame = ctx.one_frame(shape)
    if (frame is None or any(tuple(b) for b in batching)
            or not ctx.operands[1].per_sequence or ctx.operands[1].sequence_axis != 0
            or len(index_shape) != 2 or set(index_map) != set(frame)):
        return None
    r, p = frame
    if any(window[a] != 1 if a in (r, p) else not same_dim(window[a], shape[a])
           for a in range(len(shape))):
        return None
    sequence = index[..., list(index_map).index(r)].astype(np.int32)   # (rows, columns)
    position = index[..., list(index_map).index(p)].astype(np.int32)
    count = jnp.asarray(ctx.sizes[ctx.rows_name], np.int32)    # the sequences of the call
    inside = (sequence >= 0) & (sequence < count)
    sequence = jnp.clip(sequence, 0, count - 1)
    row, start, length = (jnp.take(t, sequence, mode="clip") for t in _sequence_table(ctx))
    position, here = within(eqn, position, ctx.at_lengths(shape[p], length))
    # Clamped, a position reads its (clamped) sequence; dropped, only a real sequence's own.
    inside = inside & here if drops(eqn) else here
    return r, p, row, start + position, inside


def _sequence_table(ctx: PackedCtx):
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


def _pick_sequences(ctx: PackedCtx, eqn, invals):
    """``h[jnp.arange(B), lengths - 1]`` of a packed value: each sequence's entry of the row
    and position its index names (`_sequence_and_position`), a per-sequence value."""
    x, index = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    found = None if ctx.operands[0].per_sequence else _sequence_and_position(
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
    return ctx.held_per_sequence([by_cell(picked, r_out)], [r_out])


def _put_sequences(ctx: PackedCtx, eqn, invals):
    """The transpose of `_pick_sequences`: each sequence's update, once (from its first
    cell), added into (or set at) the row and position its index names; nothing where that
    is outside the sequence it names."""
    x, index, updates = invals
    shape, dn = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"]
    if (ctx.operands[0].per_sequence or eqn.primitive.name not in ("scatter-add", "scatter")
            or dn.operand_batching_dims or not ctx.operands[1].per_sequence
            or len(dn.update_window_dims) + len(dn.inserted_window_dims) != len(shape)):
        return None
    update_shape = eqn.invars[2].aval.shape
    window = scatter_window(eqn)
    found = _sequence_and_position(
        ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
        (dn.operand_batching_dims, dn.scatter_indices_batching_dims), eqn.invars[1].aval.shape)
    if found is None or set(dn.inserted_window_dims) != {found[0], found[1]}:
        return None
    r, p, row, column, inside = found
    (r_upd,) = [d for d in range(len(update_shape)) if d not in dn.update_window_dims]
    if ctx.operands[2].per_sequence and ctx.operands[2].sequence_axis != r_upd:
        return None
    u, _ = held(ctx, updates, update_shape, ctx.operands[2])
    u = jnp.moveaxis(u, (r_upd, r_upd + 1), (0, 1))
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


def _cell_positions(ctx: PackedCtx, eqn, shape, index, index_map, window, batching,
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
    clamps the position into the sequence's own ``[0, n - 1]``, and an equation that `drops`
    fills (drops) outside it; a sequence of length 0 has no cell to read in any mode.

    ``(components, read, real)``: the index's components in its dtype (the packed row and
    the column for the row and packed ones, every component in bounds), whether each entry
    reads a position of its sequence (else the gather's fill, a dropped update), and whether
    the entry belongs to a cell in the frame of the index's packed length (the others are
    "don't care", and must never write); None for any other indexing."""
    if (ctx.operands[1].per_sequence or not hasattr(index, "shape")
            or len(index_shape) < 2):
        return None
    cells = tuple(index_shape[:-1])
    frame, index_frame = ctx.one_frame(shape), ctx.one_frame(cells)
    if frame is None or index_frame is None:
        return None
    (r, p), (s, q) = frame, index_frame
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
            or any(not same_dim(window[a], shape[a]) for a in range(len(shape))
                   if a not in (r, p, *index_map, *operand_batching))):
        return None
    m = cells[q]
    grid = lambda v: spread(v, cells, (s, q))          # noqa: E731 - (rows, m) onto the index
    real = grid(ctx.in_frame(m))
    idx = jnp.asarray(index)
    component = lambda a: idx[..., list(index_map).index(a)]  # noqa: E731
    if operand_batching:
        _, seglen = ctx.cells(m)
        start, n = grid(ctx.starts(m, 0)), grid(ctx.at_lengths(shape[p], seglen))
        named = None
    else:
        sequence = _as_int32(component(r))
        count = jnp.asarray(ctx.sizes[ctx.rows_name], np.int32)    # the sequences of the call
        named = (sequence >= 0) & (sequence < count)
        row, start, length = (jnp.take(t, jnp.clip(sequence, 0, count - 1), mode="clip")
                              for t in _sequence_table(ctx))
        n = ctx.at_lengths(shape[p], length)
    position, read = within(eqn, _as_int32(component(p)), n)
    if named is not None and drops(eqn):
        read = read & named
    column = jnp.clip(start + position, 0, shape[p] - 1)
    comps = {p: column} if named is None else {p: column, r: row}
    components = jnp.stack([comps[a].astype(idx.dtype) if a in comps else idx[..., i]
                            for i, a in enumerate(index_map)], axis=-1)
    return components, read, real


def _clamped_others(eqn, components, index_map, shape, window, skip):
    """``components`` with those of the axes not in ``skip`` clamped into their bounds unless
    the scatter ``eqn`` `drops`, so that bound in FILL_OR_DROP mode (to drop chosen entries)
    it keeps its own mode for them."""
    if drops(eqn):
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


def _pick_cells(ctx: PackedCtx, eqn, invals):
    """A gather with one index per cell (`_cell_positions`): each entry reads its sequence's
    position, at the column where the sequence starts plus that position; the gather's fill
    where the position is outside the sequence."""
    x, index = invals
    dn = eqn.params["dimension_numbers"]
    found = None if ctx.operands[0].per_sequence else _cell_positions(
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


def _put_cells(ctx: PackedCtx, eqn, invals):
    """The transpose of `_pick_cells` (and ``x.at[b, idx].add(u)``, ``.set``): each cell's
    update into its sequence's position; nothing from an entry whose position is outside its
    sequence (FILL_OR_DROP) or whose cell holds no position (outside the frame)."""
    x, index, updates = invals
    dn = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    if (ctx.operands[0].per_sequence or eqn.primitive.name not in SCATTERS
            or ctx.operands[2].per_sequence or ctx.alive is not None):
        # Inside a packed scan a row's update may come from a cell that is not real there.
        return None
    window = scatter_window(eqn)
    found = _cell_positions(ctx, eqn, shape, index, dn.scatter_dims_to_operand_dims, window,
                            (dn.operand_batching_dims, dn.scatter_indices_batching_dims),
                            eqn.invars[1].aval.shape)
    if found is None:
        return None
    components, read, real = found
    r, p = ctx.one_frame(shape)
    components = _clamped_others(eqn, components, dn.scatter_dims_to_operand_dims, shape,
                                 window, (r, p))
    # Dropped: sent past the end of the packed axis, which FILL_OR_DROP skips.
    past = list(dn.scatter_dims_to_operand_dims).index(p)
    beyond = jnp.asarray(x.shape[p], components.dtype)
    components = components.at[..., past].set(jnp.where(read & real, components[..., past],
                                                        beyond))
    return bind_eqn_with(eqn, [x, components, updates], mode=lax.GatherScatterMode.FILL_OR_DROP)


@defrule("gather", layout="per_sequence")
def _pick_any(ctx: PackedCtx, eqn, invals):
    """One position of each sequence: ``x[:, k]`` (`_pick`), batched over the rows with a
    per-sequence index (`_pick_own`), or a row and a position named per sequence
    (`_pick_sequences`); or one position per cell (`_pick_cells`); None for any other
    gather."""
    for pick in (_pick, _pick_own, _pick_sequences, _pick_cells):
        picked = pick(ctx, eqn, invals)
        if picked is not None:
            return picked
    return None


@defrule(*SCATTERS, layout="per_sequence")
def _put_any(ctx: PackedCtx, eqn, invals):
    """The transposes of `_pick_any`."""
    for put in (_put, _put_own, _put_ranked, _put_sequences, _put_cells):
        done = put(ctx, eqn, invals)
        if done is not None:
            return done
    return None


@defrule("gather", layout="pack")
def _gather_packed(ctx: PackedCtx, eqn, invals):
    picked = _pick_any(ctx, eqn, invals)
    return picked if picked is not None else packed_generic(ctx, eqn, invals)


@defrule(*SCATTERS, layout="pack")
def _scatter_packed(ctx: PackedCtx, eqn, invals):
    put = _put_any(ctx, eqn, invals)
    return put if put is not None else packed_generic(ctx, eqn, invals)


@defrule("gather", "scatter-add", layout="per_cell")
def _index_cells(ctx: PackedCtx, eqn, invals):
    """``x[:, index]`` with a per-cell index reads each sequence's own positions
    (`_gather_at_positions`, and its transpose)."""
    if not ctx.operands[1].per_cell or any(
            k.per_cell for i, k in enumerate(ctx.operands) if i != 1):
        return None
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    return _gather_at_positions(ctx, eqn, invals, shapes, tuple(eqn.outvars[0].aval.shape))


def _gather_at_positions(ctx: PackedCtx, eqn, invals, shapes, out):
    """``x[:, index]`` along a packed length with a per-cell index (``x[:, ::-1]`` indexes
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
    frame = ctx.one_frame(shape)
    where = shapes[1][:-1]             # the index's own axes: one packed length
    if not (frame is not None and tuple(index_map) == frame[1:]
            and tuple(collapsed) == frame[1:] and not dn.operand_batching_dims
            and shapes[1][-1] == 1 and len(where) == 1 and ctx.packed_axes(where)):
        raise NoRule(f"{eqn.primitive.name} with a per-cell index of another form than "
                      f"x[:, index]")
    r, p = frame
    window = (dn.offset_dims if gather else dn.update_window_dims)
    kept = [d for d in range(len(shape)) if d != p]
    if tuple(window) != tuple(d if d < p else d + 1 for d in range(len(kept))) or (
            gather and any(not same_dim(eqn.params["slice_sizes"][d], shape[d]) for d in kept)):
        raise NoRule(f"{eqn.primitive.name} with a per-cell index that does not keep every "
                      f"other axis in place")
    m = where[0]                       # the cells read (written): the index's length
    position = lax.slice_in_dim(index[..., 0], 0, m, axis=1).astype(np.int32)
    pos, seglen = ctx.cells(m)
    position, inside = within(eqn, position, ctx.at_lengths(shape[p], seglen))
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


defrule("dynamic_slice", "dynamic_update_slice", layout="per_sequence")(refused)
