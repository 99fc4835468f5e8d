"""What JAX cannot trace at a symbolic length, written in operations it can.

Five library functions of JAX's refuse a length that is a symbolic dimension although
``jax.jit`` runs them at every concrete length:

- ``lax.associative_scan`` ("associative scan over axis of non-constant size"): its
  odd/even recursion has log2(T) levels. JAX itself differentiates ``cumprod`` and
  ``cumlogsumexp`` (and ``cummax``, ``cummin``) with it, so their gradients fail too.
- ``lax.fori_loop`` with a length as its bound: JAX makes it a ``while_loop`` (its trip count
  is not a constant), which reverse-mode differentiation refuses.
- the gradient of ``reduce_prod`` (``jnp.prod``) over a length: JAX's derivative halves the
  axis until one element is left, comparing the length with 1 at each step.
- ``lax.conv_general_dilated`` given a padding that depends on the length: JAX's transposes
  of a strided convolution (``T - 2*floordiv(T - 1, 2)``), its ``jax.vmap`` rule for SAME
  with a stride, equinox's ``Conv`` with ``padding="SAME"`` all pass one, and the function
  checks each amount with ``operator.index``, although the primitive's shape rule and
  lowering take it (JAX's own SAME padding is bound so).
- ``jnp.searchsorted`` with its default ``method="scan"`` (and ``jnp.digitize``, which calls
  it) over a sorted array along a length: its binary search takes ``ceil(log2(T + 1))``
  steps, a number JAX needs as an int.

While polyexec traces a function (`symbolic_trace`; per thread) and only where the length is
symbolic, each is computed by an equal form that JAX traces over a symbolic length and whose
every operation has a logical rule, so padded, ragged and packed rows keep it exact:

- a prefix scan runs as a Hillis-Steele scan: at level k each position combines with the one
  2**k before it (a ``pad`` that shifts the axis, kept only where ``position >= 2**k``), for
  as many levels as the length's upper bound needs. Causal, so the real prefix reads only real
  cells; in packed rows the shift and the position are within each sequence, so the scan
  restarts at every sequence start. ``reverse=True`` flips, scans and flips back, as JAX does.
  It combines in another order than JAX's recursion: equal up to float rounding. Not for a
  combine whose derivative splits a tie between its operands (``lax.max``, ``jnp.minimum``:
  so not for the gradients of ``cummax`` and ``cummin``): the split follows the order of the
  combines, so those stay JAX's own, refused over a symbolic length. A combine of one's own
  that splits ties so (``lambda a, b: jnp.where(a > b, a, b)`` is fine; a hand-written
  smooth max is not) gets other gradients at ties than ``jax.jit``.
- ``fori_loop(lo, T, body, init)`` runs as ``lax.scan`` over ``lo + arange(T - lo)``: what
  JAX itself does for a constant trip count, and what polyexec already makes exact per row.
- ``reduce_prod``'s derivative is the sum of each tangent times the product of the other
  cells, made of exclusive cumulative products from both ends (no division, so zeros are
  right).
- the convolution binds its primitive with the padding as given; its logical rule places an
  operand whose low padding is a length expression (SAME with a stride; the input gradient,
  input-dilated by the stride) at its logical offset, and zeroes the tails otherwise, so a
  strided convolution's gradients w.r.t. input and kernel are exact padded and ragged. Packed
  rows run it padded: a strided result has no room at each sequence's own column.
- the search runs as JAX's own ``method="compare_all"``: each query counts the sorted cells
  below it, the same integer (a search's answer is unique), in ``T`` comparisons a query
  instead of log2(T) steps.

Everywhere else -- a concrete length, any other thread, a trace that is not polyexec's -- JAX's
own function runs unchanged: the replacements are installed once, in JAX's modules where
JAX's code and users' code look them up (`_jax_internals.install_symbolic_forms`), and each
asks `active` before doing anything of its own.

>>> import jax, jax.numpy as jnp, numpy as np, polyexec as px
>>> T = px.LengthVar("T", min=1, max=64)
>>> f = px.bucketed(lambda x: jax.lax.associative_scan(jnp.add, x), in_specs=(px.Spec("T"),))
>>> f(np.arange(1.0, 6.0, dtype=np.float32)).tolist()
[1.0, 3.0, 6.0, 10.0, 15.0]
>>> f.plan.reshaping_is_impossible
False
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import export, lax

from . import _jax_internals

_state = threading.local()


@contextlib.contextmanager
def symbolic_trace() -> Iterator[None]:
    """The block in which this thread traces a function for polyexec over symbolic lengths."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def concrete_trace(longest: int) -> Iterator[None]:
    """The block in which this thread traces a function for polyexec at concrete sizes, to
    recover its symbolic program from several (`_recover`): the forms run at every size, so
    the programs have one structure, a prefix scan taking as many levels as ``longest`` (the
    largest max of the plan's variables) needs whatever its axis (an axis longer than that is
    no length: the same size in every trace).

    The block is part of JAX's trace context (`_jax_internals.concrete_forms`): a jitted
    helper traced in it is cached apart, so plain calls of it at the same sizes afterwards
    still get JAX's own functions."""
    with _jax_internals.concrete_forms(longest):
        yield


def _longest() -> int | None:
    """The ``longest`` of the `concrete_trace` this thread is in (None: in none)."""
    return _jax_internals.concrete_forms.value or None


def _levels(n) -> int | None:
    """How many doubling steps cover an axis of ``n`` cells (None: not polyexec's to scan)."""
    longest = _longest()
    if longest is not None and not export.is_symbolic_dim(n):
        upper = max(n, longest)
    elif active() and export.is_symbolic_dim(n):
        upper = _jax_internals.dim_bounds(n)[1]
        if not math.isfinite(upper):
            return None
    else:
        return None
    return max(0, math.ceil(math.log2(max(upper, 1))))


def _applies(*dims) -> bool:
    """Whether a form replaces JAX's function for an operation over these axes."""
    if _longest() is not None:
        return True
    return active() and any(export.is_symbolic_dim(d) for d in dims)


def prefix_scan(original: Callable) -> Callable:
    """``lax.associative_scan`` that runs as a Hillis-Steele scan over a symbolic length."""

    def associative_scan(fn, elems, reverse=False, axis=0):
        leaves, tree = jax.tree.flatten(elems)
        if not (leaves and callable(fn)) or any(fn is f for f in _TIE_SPLITTING):
            return original(fn, elems, reverse=reverse, axis=axis)
        axis = axis % max(jnp.ndim(leaves[0]), 1)
        levels = _levels(jnp.shape(leaves[0])[axis])
        if levels is None:
            return original(fn, elems, reverse=reverse, axis=axis)
        leaves = [jnp.asarray(leaf) for leaf in leaves]
        if reverse:
            leaves = [lax.rev(leaf, (axis,)) for leaf in leaves]
        for k in range(levels):
            step = 1 << k
            kept = [lax.broadcasted_iota(np.int32, leaf.shape, axis) >= step for leaf in leaves]
            # Position i combines i - step with i. Where there is no i - step it combines
            # itself with itself, thrown away; its operands hold no gradient, so a combine
            # whose derivative is infinite there (sqrt(a*a + b*b) at 0) cannot make a NaN.
            earlier = [jnp.where(keep, _shifted(leaf, axis, step), lax.stop_gradient(leaf))
                       for keep, leaf in zip(kept, leaves)]
            later = [jnp.where(keep, leaf, lax.stop_gradient(leaf))
                     for keep, leaf in zip(kept, leaves)]
            combined = jax.tree.leaves(fn(jax.tree.unflatten(tree, earlier),
                                          jax.tree.unflatten(tree, later)))
            leaves = [jnp.where(keep, c, leaf) for keep, c, leaf in zip(kept, combined, leaves)]
        if reverse:
            leaves = [lax.rev(leaf, (axis,)) for leaf in leaves]
        return jax.tree.unflatten(tree, leaves)

    associative_scan.__wrapped__, associative_scan.polyexec_form = original, True
    return associative_scan


# Combines whose derivative splits a tie between its operands: the split depends on the order
# of the combines, which only JAX's own recursion at the exact length reproduces. Their scans
# (and the gradients of cummax and cummin, made with lax.max and lax.min) stay JAX's: over a
# symbolic length they are refused, and the verdict names the line.
_TIE_SPLITTING = (lax.max, lax.min, jnp.maximum, jnp.minimum, jnp.fmax, jnp.fmin)


def _shifted(x, axis: int, step: int, fill=0):
    """``x`` moved ``step`` cells along ``axis`` (toward the end; back for a negative
    ``step``), ``fill`` entering where it leaves."""
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (step, -step, 0)
    return lax.pad(x, jnp.asarray(fill, x.dtype), config)


def fori_as_scan(original: Callable) -> Callable:
    """``lax.fori_loop`` that runs as a scan when its trip count is a symbolic length."""

    def fori_loop(lower, upper, body_fun, init_val, **kwargs):
        symbolic = any(export.is_symbolic_dim(b) for b in (lower, upper))
        if not (active() and symbolic and all(_is_dim(b) for b in (lower, upper))):
            return original(lower, upper, body_fun, init_val, **kwargs)
        unroll = kwargs.get("unroll") or 1
        indices = lower + lax.iota(np.int32, upper - lower)
        return lax.scan(lambda carry, i: (body_fun(i, carry), None), init_val, indices,
                        unroll=unroll)[0]

    fori_loop.__wrapped__, fori_loop.polyexec_form = original, True
    return fori_loop


def _is_dim(bound) -> bool:
    return export.is_symbolic_dim(bound) or isinstance(bound, (int, np.integer))


def prod_jvp(original: Callable, reduce_prod: Callable) -> Callable:
    """``reduce_prod``'s derivative rule, in exclusive products over a symbolic axis."""

    def jvp(primals, tangents, *, axes, **params):
        (x,), (t,) = primals, tangents
        if not _applies(*(x.shape[a] for a in axes)):
            return original(primals, tangents, axes=axes, **params)
        others = jnp.ones_like(x)
        # The cells j != i: those that first differ from i along axes[m], for each m -- the
        # product along axes[m] excluding i, of x already multiplied along the later axes.
        for m, axis in enumerate(axes):
            later = tuple(axes[m + 1:])
            partial = jnp.prod(x, axis=later, keepdims=True) if later else x
            others = others * _exclusive_product(partial, axis)
        return reduce_prod(x, axes=axes, **params), jnp.sum(t * others, axis=tuple(axes))

    jvp.__wrapped__, jvp.polyexec_form = original, True
    return jvp


def _exclusive_product(x, axis: int):
    """At each cell, the product of the cells before it and after it along ``axis``."""
    return (_shifted(lax.cumprod(x, axis), axis, 1, fill=1)
            * _shifted(lax.cumprod(x, axis, reverse=True), axis, -1, fill=1))


def conv_padding(original: Callable, bind: Callable) -> Callable:
    """``lax.conv_general_dilated`` as JAX calls it in its own rules (the transposes of a
    convolution, its batching rule), taking a padding that is a symbolic dimension."""

    def conv_general_dilated(lhs, rhs, window_strides, padding, *args, **kwargs):
        if not (active() and not isinstance(padding, str)
                and any(export.is_symbolic_dim(p) for pair in padding for p in pair)):
            return original(lhs, rhs, window_strides, padding, *args, **kwargs)
        return bind(lhs, rhs, window_strides, padding, *args, **kwargs)

    conv_general_dilated.__wrapped__, conv_general_dilated.polyexec_form = original, True
    return conv_general_dilated


def search_by_counting(original: Callable, implementation: Callable) -> Callable:
    """JAX's searchsorted, counting instead of bisecting along a symbolic length. Bound
    without JAX's primitive wrapper, which checks that the length fits the index type by
    converting it to an int (``jnp.searchsorted`` has chosen that type from the length)."""

    def searchsorted_via_expand(sorted_arr, query, /, *, side="left", dimension=0,
                                batch_dims=0, method="scan", dtype="int32"):
        if method in ("scan", "scan_unrolled") and _applies(jnp.shape(sorted_arr)[dimension]):
            return implementation(sorted_arr, query, dimension=dimension, batch_dims=batch_dims,
                                  side=side, dtype=np.dtype(dtype), method="compare_all")
        return original(sorted_arr, query, side=side, dimension=dimension,
                        batch_dims=batch_dims, method=method, dtype=dtype)

    searchsorted_via_expand.__wrapped__, searchsorted_via_expand.polyexec_form = original, True
    return searchsorted_via_expand


_jax_internals.install_symbolic_forms(prefix_scan=prefix_scan, fori_as_scan=fori_as_scan,
                                      prod_jvp=prod_jvp, conv_padding=conv_padding,
                                      search_by_counting=search_by_counting)
