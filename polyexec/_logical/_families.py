"""The families of primitives that combine entries along an axis, each with its combiner and
identity stated once (JAX's batching rules state them once too, in ``defreducer(prim,
ident)``). Every layout's rule reads them here: the padded rules fill a length's tail with the
identity, the packed ones restart a running value from it at each sequence's first cell, a
window reads it past a sequence's edges, a scatter from a row that has ended adds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from ._basics import all_ones, highest_value, lowest_value


class Monoid(NamedTuple):
    combine: Callable[[Any, Any], Any] | None   # None: the family has no elementwise combiner
    identity: Callable[[Any], Any]               # dtype -> the value that changes nothing
    # The same combination as a scatter (``x.at[i].add``: "add", "max", "min", "mul"), how
    # packed rows combine each sequence's cells; None: none (``xor``).
    segment: str | None = None


def _zero(dtype):
    return 0


def _one(dtype):
    return 1


SUM = Monoid(lax.add, _zero, "add")
PRODUCT = Monoid(lax.mul, _one, "mul")
MAX = Monoid(lax.max, lowest_value, "max")
MIN = Monoid(lax.min, highest_value, "min")

REDUCERS: dict[str, Monoid] = {
    "reduce_sum": SUM, "reduce_prod": PRODUCT, "reduce_max": MAX, "reduce_min": MIN,
    # On booleans (as int8 in packed rows) ``and`` is a min and ``or`` a max.
    "reduce_and": Monoid(lax.bitwise_and, all_ones, "min"),
    "reduce_or": Monoid(lax.bitwise_or, _zero, "max"),
    "reduce_xor": Monoid(lax.bitwise_xor, _zero),
    # An arg-reduction's tail must lose to every real entry: the value it compares by.
    "argmax": Monoid(None, lowest_value), "argmin": Monoid(None, highest_value),
}

CUMULATIVE: dict[str, Monoid] = {
    "cumsum": SUM, "cumprod": PRODUCT, "cummax": MAX, "cummin": MIN,
    "cumlogsumexp": Monoid(jnp.logaddexp, lowest_value),
}

# What a window combines, and what it reads past an edge (`lax.reduce_window`'s init value).
WINDOWS: dict[str, Monoid] = {"reduce_window_sum": SUM, "reduce_window_max": MAX,
                              "reduce_window_min": MIN}

# A combining scatter's identity: what an update that must change nothing adds. A plain
# ``scatter`` replaces, so no update is neutral (None).
SCATTERS: dict[str, Monoid | None] = {
    "scatter": None, "scatter-add": SUM, "scatter-sub": Monoid(lax.sub, _zero),
    "scatter-mul": PRODUCT, "scatter-min": MIN, "scatter-max": MAX,
}
