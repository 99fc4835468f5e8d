"""Shape helpers that keep a program polymorphic: sizes come from arrays, never from ints."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend import source_info_util

# Equations made inside these helpers are attributed to the user's call line (describe()).
source_info_util.register_exclusion(__file__)


def arange_like(x, axis: int = 0, dtype=jnp.int32):
    """``0, 1, ..., x.shape[axis] - 1`` with the size taken from ``x`` (symbolic-safe).

    >>> import numpy as np, polyexec as px
    >>> px.arange_like(np.zeros((2, 3)), axis=1).tolist()
    [0, 1, 2]
    """
    return lax.iota(dtype, x.shape[axis])


def sequence_mask(lengths, like, axis: int = 1):
    """Boolean mask ``[..., t] = t < lengths[...]``, with as many positions as ``like.shape[axis]``.

    >>> import numpy as np, polyexec as px
    >>> px.sequence_mask(np.array([1, 3]), np.zeros((2, 4)), axis=1).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 1, 0]]
    """
    lengths = jnp.asarray(lengths)
    positions = arange_like(like, axis, lengths.dtype)
    return positions < lengths[..., None]


def reshape_like(x, like):
    """``x`` reshaped to ``like.shape``, symbolic dims included.

    >>> import numpy as np, polyexec as px
    >>> px.reshape_like(np.arange(6), np.zeros((2, 3))).shape
    (2, 3)
    """
    return jnp.reshape(x, like.shape)


def broadcast_like(x, like):
    """``x`` broadcast to ``like.shape`` (use instead of a literal maximum such as ``1024``).

    >>> import numpy as np, polyexec as px
    >>> px.broadcast_like(np.float32(1), np.zeros((2, 3))).shape
    (2, 3)
    """
    return jnp.broadcast_to(x, like.shape)
