"""Rules for random draws shaped by a length (``random_bits``: dropout, ``jax.random.uniform``,
``normal``, ``bernoulli`` of ``x.shape``, typed keys and raw ``PRNGKey`` ones alike).

JAX's draw at a shape depends on the whole shape: the same key drawing ``(B, 16, F)`` and
``(B, 32, F)`` gives a real cell different bits. No rewrite can make the padded draw equal the
unpadded one, so the contract here (DESIGN.md) is *layout invariance*: a real cell's draw
depends on the key, its coordinates along the length axes and the constant-size rest of the
shape, never on the bucket, on how many padding rows or columns surround it, or on its
neighbours. Padding cells draw something too; no result reads them (the rewrite's masks keep
the padding out, as for any value).

Packed rows hold several sequences per row. There a cell's coordinates are its sequence's index
in the call's batch (a layout input, read only by a program that draws) and its position in
that sequence, so cell ``(r, c)`` holding position ``t`` of the call's row ``b`` draws exactly
what cell ``(b, t)`` draws padded: the same example gets the same mask in every bucket and
layout.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from .._jax_internals import dim_vars
from ._core import NoRule, bind_eqn_with, defrule, is_sym, padded_rule
from ._sequences import PerSequence, grid_shape, spread


def _threefry_only(key) -> None:
    impl = str(jax.random.key_impl(key))
    if impl != "threefry2x32":
        # An RBG key's draws over a batch of keys depend on the batch's shape (XLA's
        # RngBitGenerator), so a per-cell key would still draw by the bucket.
        raise NoRule(f"a random draw along a length with a {impl!r} key: its bits depend on "
                     f"the bucket's shape; use a threefry key (jax.random.key(seed), the "
                     f"default) for dropout that padding cannot change")


def _draw_per_cell(eqn, key, index, grid_axes=None):
    """``random_bits`` of ``eqn``'s shape where every cell along its length axes draws from
    ``key`` folded with that cell's ``index`` arrays (in order, each of the grid's shape), and
    JAX draws the constant-size axes within it. The grid's axes go to ``grid_axes`` of the
    result, the constant-size ones to the rest in order (default: the shape's length axes,
    each where it is). A batch of keys (a key array of shape ``K``) draws per key, as JAX's
    own batching of the primitive does."""
    shape = tuple(eqn.params["shape"])
    rest = tuple(d for d in shape if not is_sym(d))
    if grid_axes is None:
        grid_axes = [a for a, d in enumerate(shape) if is_sym(d)]
    n_index = len(index)

    def one_cell(k, *at):
        for i in at:
            k = jax.random.fold_in(k, i)
        return bind_eqn_with(eqn, [k], shape=rest)[0]

    # Each index array has the grid's shape; vmapped once per grid axis.
    draw = one_cell
    for _ in grid_axes:
        draw = jax.vmap(draw, in_axes=(None, *[0] * n_index))
    for _ in range(key.ndim):       # a key array: per key, in front
        draw = jax.vmap(draw, in_axes=(0, *[None] * n_index))
    bits = draw(key, *[lax.convert_element_type(i, np.uint32) for i in index])  # K+grid+rest
    # Put each grid axis at its place in the result.
    nk, rank = key.ndim, len(grid_axes) + len(rest)
    order = [None] * rank
    for j, a in enumerate(grid_axes):
        order[a] = nk + j
    rest_axes = iter(range(nk + len(grid_axes), nk + rank))
    order = [o if o is not None else next(rest_axes) for o in order]
    return [lax.transpose(bits, (*range(nk), *order))]


@defrule("random_bits")
def _random_bits(ctx, eqn, invals):
    """``random_bits(key, shape)`` with length axes in ``shape``: each cell draws from the key
    folded with its index along every length axis, in order, and JAX draws the constant-size
    axes within it. For a shape ``(B, T, F)`` with ``B`` and ``T`` lengths, cell ``(b, t, :)``
    is ``random_bits(fold_in(fold_in(key, b), t), shape=(F,))``: it depends on the key, ``b``,
    ``t`` and ``F`` only. The index along a length axis is layout-invariant: the logical
    positions of every axis hold the exact-size layout (the rewrite's invariant), padding only
    comes after them, and a ragged row's position ``t`` is its own. A batch of keys draws per
    key. Threefry keys only (the default): an RBG key's batched draw depends on the batch's
    shape."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    grid = tuple(d for d in shape if is_sym(d))
    if not grid:
        return None                 # per key: each key's draw is its own already
    _threefry_only(key)
    return _draw_per_cell(eqn, key, [lax.broadcasted_iota(np.int32, grid, j)
                                     for j in range(len(grid))])


@defrule("random_bits", layout="pack")
def _random_bits_packed(ctx, eqn, invals):
    """A draw along the packed rows and a packed length draws what the pad layout draws at
    each real cell: along the rows axis the cell's sequence's index in the call's batch, along
    a packed length (``T``, ``T - 1``; two of them for attention's ``(B, H, T, T)``) its
    position in that sequence, so cell ``(r, c)`` holding position ``t`` of the call's row
    ``b`` is ``random_bits(fold_in(fold_in(key, b), t), (F,))``. A pair of cells of two
    sequences, or a cell outside every sequence, draws something no result reads (the frame
    keeps it out). One along other lengths only (a per-position ``(T, F)`` noise shared by
    every sequence has no rows axis: position ``t`` draws the same in either layout) is the
    padded rule. A draw along the rows alone (a per-sequence ``(B, F)`` noise) is per
    sequence: each sequence draws by its index, what its row draws padded, held at every cell
    of it (`PerSequence`)."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    rows = ctx.row_axes(shape)
    if not rows:
        return padded_rule(eqn)(ctx, eqn, invals)
    packed = ctx.packed_axes(shape)
    counts = [a for a, d in enumerate(shape)
              if is_sym(d) and ctx.rows_name in dim_vars(d) and a not in rows]
    if len(rows) == 1 and not packed and not counts:
        return _draw_per_sequence(ctx, eqn, key, rows[0])
    if len(rows) != 1 or not packed or counts:
        raise NoRule(f"a random draw of shape {shape} over packed rows: only one rows axis "
                     f"with one or two packed lengths draws by its sequence and position")
    _threefry_only(key)
    (r,), p = rows, packed[0]
    lengths = [a for a, d in enumerate(shape) if is_sym(d)]
    grid = tuple(shape[a] for a in lengths)

    def per_cell(value, axis):      # a (rows, d) array of the cells along the packed ``axis``
        return spread(value, grid, (lengths.index(r), lengths.index(axis)))

    index = []
    for j, a in enumerate(lengths):
        if a == r:
            index.append(per_cell(ctx.sequence_index(shape[p]), p))
        elif a in packed:
            index.append(per_cell(ctx.cells(shape[a])[0], a))
        else:                       # another length variable: padded, as in the pad layout
            index.append(lax.broadcasted_iota(np.int32, grid, j))
    return _draw_per_cell(eqn, key, index)


def _draw_per_sequence(ctx, eqn, key, r: int):
    """``random_bits`` of a shape with the rows axis ``r`` and no packed length, as a
    `PerSequence` (the columns after the rows): cell ``(r, c)`` draws what the pad layout's
    row ``b`` draws, ``b`` the index of the sequence there, folding in each other length
    axis's index as the pad layout does. A cell outside every sequence draws something no
    result reads."""
    _threefry_only(key)
    shape = tuple(eqn.params["shape"])
    lengths = [a for a, d in enumerate(shape) if is_sym(d)]
    held_shape = grid_shape(ctx, shape, r)
    held_lengths = [a + (a > r) for a in lengths]
    grid = tuple(held_shape[a] for a in sorted([*held_lengths, r + 1]))
    grid_axes = sorted([*held_lengths, r + 1])
    rows_at = grid_axes.index(r)
    sequence = spread(ctx.sequence_index(ctx.pos.shape[1]), grid, (rows_at, rows_at + 1))
    index = [sequence if a == r else lax.broadcasted_iota(np.int32, grid, grid_axes.index(a + (a > r)))
             for a in lengths]
    return [PerSequence(_draw_per_cell(eqn, key, index, grid_axes)[0], r)]
