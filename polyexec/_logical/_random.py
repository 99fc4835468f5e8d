"""Rules for random draws shaped by a length (``random_bits``: dropout, ``jax.random.uniform``,
``normal``, ``bernoulli`` of ``x.shape``, typed keys and raw ``PRNGKey`` ones alike).

JAX's draw at a shape depends on the whole shape: the same key drawing ``(B, 16, F)`` and
``(B, 32, F)`` gives a real cell different bits. No rewrite can make the padded draw equal the
unpadded one, so the contract here (DESIGN.md) is *layout invariance*: a real cell's draw
depends on the key, its coordinates along the length axes and the constant-size rest of the
shape, never on the bucket, on how many padding rows or columns surround it, or on its
neighbours. Padding cells draw something too; no result reads them (the rewrite's masks keep
the padding out, as for any value).

Packed rows hold several sequences per row, and their program knows each cell's position in its
sequence but not the sequence's index in the call's batch: a draw there would follow the packed
row, not the sequence, so the packed rule refuses (``layout="pack"`` and ``"auto"`` then run the
pad layout, where the draw is layout-invariant).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from .._jax_internals import dim_vars
from ._core import NoRule, bind_eqn_with, defrule, is_sym, padded_rule


@defrule("random_bits")
def _random_bits(ctx, eqn, invals):
    """``random_bits(key, shape)`` with length axes in ``shape``: each cell draws from the key
    folded with its index along every length axis, in order, and JAX draws the constant-size
    axes within it. For a shape ``(B, T, F)`` with ``B`` and ``T`` lengths, cell ``(b, t, :)``
    is ``random_bits(fold_in(fold_in(key, b), t), shape=(F,))``: it depends on the key, ``b``,
    ``t`` and ``F`` only. The index along a length axis is layout-invariant: the logical
    positions of every axis hold the exact-size layout (the rewrite's invariant), padding only
    comes after them, and a ragged row's position ``t`` is its own. A batch of keys (a key
    array of shape ``K``) draws per key, as JAX's own batching of the primitive does. Threefry
    keys only (the default): an RBG key's batched draw depends on the batch's shape."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    lengths = [a for a, d in enumerate(shape) if is_sym(d)]
    if not lengths:
        return None                 # per key: each key's draw is its own already
    impl = str(jax.random.key_impl(key))
    if impl != "threefry2x32":
        # An RBG key's draws over a batch of keys depend on the batch's shape (XLA's
        # RngBitGenerator), so a per-cell key would still draw by the bucket.
        raise NoRule(f"a random draw along a length with a {impl!r} key: its bits depend on "
                     f"the bucket's shape; use a threefry key (jax.random.key(seed), the "
                     f"default) for dropout that padding cannot change")
    rest = tuple(d for d in shape if not is_sym(d))

    def one_cell(k, *index):
        for i in index:
            k = jax.random.fold_in(k, i)
        return bind_eqn_with(eqn, [k], shape=rest)[0]

    # One index array per length axis, each of the lengths' shape; vmapped once per axis.
    grid = tuple(shape[a] for a in lengths)
    index = [lax.broadcasted_iota(np.uint32, grid, j) for j in range(len(grid))]
    draw = one_cell
    for _ in grid:
        draw = jax.vmap(draw, in_axes=(None, *[0] * len(grid)))
    for _ in range(key.ndim):       # a key array: per key, in front
        draw = jax.vmap(draw, in_axes=(0, *[None] * len(grid)))
    bits = draw(key, *index)        # K + grid + rest
    # Put each length axis back at its place in ``shape``.
    nk = key.ndim
    order = [None] * len(shape)
    for j, a in enumerate(lengths):
        order[a] = nk + j
    rest_axes = iter(range(nk + len(grid), nk + len(shape)))
    order = [o if o is not None else next(rest_axes) for o in order]
    return [lax.transpose(bits, (*range(nk), *order))]


@defrule("random_bits", layout="pack")
def _random_bits_packed(ctx, eqn, invals):
    """A draw along a packed length or the packed rows is refused: its cells would draw by
    their packed row and column, and the packed program has no sequence index to fold in.
    One along other lengths only (a per-position ``(T, F)`` noise shared by every sequence
    has no rows axis: position ``t`` draws the same in either layout) is the padded rule."""
    shape = tuple(eqn.params["shape"])
    if any(ctx.rows_name in dim_vars(d) for d in shape if is_sym(d)):
        raise NoRule("a random draw along a packed length: its cells would draw by their "
                     "packed row, not their sequence")
    return padded_rule(eqn)(ctx, eqn, invals)
