"""Rules for indexing: ``dynamic_slice``, ``dynamic_update_slice``, ``gather``, ``scatter*``.

Start indices are clamped (or dropped, in FILL_OR_DROP mode) against logical bounds, with room
padded at the end where a logical start would not fit physically; scattered rows and window
elements beyond a logical length are dropped, made the combiner's identity, or (plain scatter,
update slice) overwritten back with the operand, so they never land in a logical position.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._core import (NoRule, RowVarying, bind_eqn_with, defrule, fill_tail, filled, has_sym,
                    highest_value, iota_along, is_sym, literal_start, logical_mask, lowest_value,
                    one_position, operand_avals, same_dim, window_fits_admitted_rows)
from ._families import SCATTERS


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


def _held_index(rule, per_row):
    """A gather (scatter) whose index is held per row (`RowVarying`) reads (writes) each row
    at its own position when it has the one-position form (`_per_row_position`,
    `_per_row_put`) -- rather than running once per row over the whole operand, B times
    the work; None for any other, which does run per row (`_eval_row_varying`)."""
    def held(ctx, eqn, invals):
        x, idx, *rest = invals
        if isinstance(x, RowVarying) or not isinstance(idx, RowVarying) or any(
                isinstance(u, RowVarying) for u in rest):
            return None
        return per_row(ctx, eqn, x, idx, *rest)
    rule.row_varying = held
    return rule


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
    fill_mode = p["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    comps, oob = _bounded_indices(idx, bounds, check=fill_mode, clamp=True)
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


def _one_index(idx) -> bool:
    """Whether ``idx`` is one index vector: for all rows, or one per row (held per row with
    the rows in front)."""
    held = isinstance(idx, RowVarying)
    return jnp.ndim(idx.value if held else idx) == 1 + held


def _position_per_row(ctx, x, t, idx, component, mode):
    """The position each row reads along ``t``, shaped to broadcast along ``x``: one index
    for all rows, or each row's own (held per row, `RowVarying`: ``x[:, t]`` inside a scan
    over ``jnp.arange(x.shape[1])``, which JAX normalises by ``x.shape[1]``, each row's
    length); and where, in FILL_OR_DROP mode, the other components (starts of whole axes,
    which fit only at 0) put the window out of bounds (None: nowhere)."""
    if isinstance(idx, RowVarying):
        (axis,) = ctx.row_axes(x.shape, idx.rows)
        one = tuple(d if a == axis else 1 for a, d in enumerate(x.shape))
        idx = lax.broadcast_in_dim(idx.value, (*one, idx.value.shape[-1]), (axis, x.ndim))
    k, others = idx[..., component], None
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        for c in range(idx.shape[-1]):
            if c != component:
                bad = idx[..., c] != 0
                others = bad if others is None else others | bad
    return k, others


def _per_row_position(ctx, eqn, x, idx):
    """``x[:, k]`` of a ``(B, T, ...)`` value whose ``T`` differs per row: each row's own
    position ``k``, clamped into its own length as at its exact size (the gather's fill
    outside it in FILL_OR_DROP mode, and in a row of length 0, which has no position); None
    for any other gather. ``k`` may differ per row (`_position_per_row`)."""
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    if not _one_index(idx):
        return None
    found = _one_position_axis(ctx, x.shape, p["slice_sizes"], dn.start_index_map,
                               dn.collapsed_slice_dims, dn.offset_dims, dn.operand_batching_dims)
    if found is None:
        return None
    t, component = found
    n = ctx.length(x.shape[t], shape=x.shape)       # per row, shaped to broadcast along x
    k, others = _position_per_row(ctx, x, t, idx, component, p["mode"])
    one = tuple(1 if a == t else d for a, d in enumerate(x.shape))
    position = jnp.broadcast_to(jnp.clip(k, 0, jnp.maximum(n - 1, 0)).astype(np.int32), one)
    out = jnp.take_along_axis(x, position, axis=t, mode="clip")
    outside = ((k < 0) | (k >= n)) if p["mode"] == lax.GatherScatterMode.FILL_OR_DROP else n <= 0
    outside = outside if others is None else outside | others
    outside = jnp.broadcast_to(outside, one)
    out = lax.select(outside, filled(out.shape, gather_fill(p, out.dtype), out.dtype), out)
    return [lax.squeeze(out, (t,)) if t in dn.collapsed_slice_dims else out]


def _per_row_put(ctx, eqn, x, idx, updates):
    """The transpose of `_per_row_position` (``x.at[:, k].add(u)``, ``.set``): each row's
    update into its own position ``k`` (clamped into its length, or dropped outside it in
    FILL_OR_DROP mode, and in a row of length 0); None for any other scatter."""
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    if eqn.primitive.name not in ("scatter-add", "scatter") or not _one_index(idx):
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
    k, others = _position_per_row(ctx, x, t, idx, component, p["mode"])
    drop = ((k < 0) | (k >= n)) if p["mode"] == lax.GatherScatterMode.FILL_OR_DROP else n <= 0
    drop = drop if others is None else drop | others
    at = (iota_along(x.shape, t) == jnp.clip(k, 0, jnp.maximum(n - 1, 0))) & ~drop
    if t not in dn.inserted_window_dims:
        updates = lax.squeeze(updates, (t,))
    spread = lax.broadcast_in_dim(updates, x.shape, tuple(a for a in range(x.ndim) if a != t))
    if eqn.primitive.name == "scatter":
        return [lax.select(at, spread, x)]
    return [x + lax.select(at, spread, filled(x.shape, 0, x.dtype))]


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


@defrule("scatter", "scatter-add", acts_on=_scatter_acts_on)
@defrule(*(name for name in SCATTERS if name not in ("scatter", "scatter-add")))
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
                                SCATTERS[name].identity(updates.dtype))
        elif name != "scatter":
            raise NoRule(f"{name} with a window of a length")
    if not dn.scatter_dims_to_operand_dims:
        if rows or (window_tail and name == "scatter"):
            raise NoRule("a scatter without indices whose rows or windows are lengths")
        return bind_eqn_with(eqn, [x, idx, updates])
    # Clamp (CLIP, PROMISE_IN_BOUNDS) or drop (FILL_OR_DROP) against the logical bounds, then
    # drop rows beyond the updates' logical lengths by sending them out of bounds.
    drop_mode = p["mode"] == lax.GatherScatterMode.FILL_OR_DROP
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


_held_index(_gather, _per_row_position)
_held_index(_scatter, _per_row_put)
