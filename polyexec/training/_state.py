"""The training state: model, optimiser state and step count, as one immutable pytree."""

from __future__ import annotations

import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._errors import OptionError


class TrainState(eqx.Module):
    """Everything a train step reads and returns: ``model``, ``opt_state`` and ``step``.

    An `equinox.Module`, so it is immutable and a pytree: a step takes one and returns a new
    one (optax style), and checkpoints serialise it with ``eqx.tree_serialise_leaves``.
    ``opt_state`` is the optimiser's state for the model's trainable arrays (`trainable`: its
    floating-point arrays, of a Flax NNX model its ``nnx.Param`` ones); ``step`` is an int32
    array so that it lives on the device with the rest and is donated with it.

    >>> import equinox as eqx, jax, optax
    >>> from polyexec.training import TrainState
    >>> state = TrainState.create(eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))
    >>> int(state.step)
    0
    """

    model: Any
    opt_state: Any
    step: jax.Array

    @classmethod
    def create(cls, model: Any, optimizer: optax.GradientTransformation) -> "TrainState":
        if not isinstance(optimizer, optax.GradientTransformation):
            raise OptionError(f"TrainState.create: optimizer: expected an "
                              f"optax.GradientTransformation (e.g. optax.adam(1e-3)), received "
                              f"{type(optimizer).__name__}")
        params, _ = trainable(model)
        return cls(model=model, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def trainable(model: Any) -> tuple[Any, Any]:
    """``(params, rest)``: ``model`` split (`eqx.partition`) into the arrays the optimiser
    trains and everything else, which a train step carries through as the call left it.

    Trained: floating-point arrays -- of a Flax NNX model only those in an ``nnx.Param``, as
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` trains, and none in an ``eqx.nn.State``. The
    rest is state: an ``nnx.BatchStat``
    is a float array too, but it is written by the layer (running statistics), never by
    a gradient (an optimiser with weight decay would pull it to 0); RNG counts and keys, and
    an equinox model's integer arrays, are not differentiable at all.

    >>> import equinox as eqx, jax
    >>> params, rest = trainable(eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0)))
    >>> params.weight.shape, rest.weight is None
    ((1, 2), True)
    """
    nnx = sys.modules.get("flax.nnx")   # imported by whoever built an NNX model, else none here
    variable = nnx.Variable if nnx is not None else ()

    def decide(leaf):
        if isinstance(leaf, eqx.nn.State):     # equinox's state (eqx.nn.make_with_state)
            return jax.tree_util.tree_map(lambda _: False, leaf)
        if nnx is not None and isinstance(leaf, variable):   # a pytree node over its value
            trained = isinstance(leaf, nnx.Param)
            return jax.tree_util.tree_map(lambda x: trained and eqx.is_inexact_array(x), leaf)
        return eqx.is_inexact_array(leaf)

    spec = jax.tree_util.tree_map(
        decide, model, is_leaf=lambda x: isinstance(x, (eqx.nn.State, *(
            (variable,) if nnx is not None else ()))))
    return eqx.partition(model, spec)


def copy_arrays(tree: Any) -> Any:
    """``tree`` with every array leaf copied (other leaves as they are): the steps donate their
    state's buffers, so what a caller still holds must not be those buffers.

    The runtime copies each buffer (``device_put(may_alias=False)``: same sharding, same
    bytes); ``jnp.copy`` compiled an XLA program per array shape for it -- 7 for a GRU's
    `TrainState`, made again for each state `measure_cost` timed a call on, none of them a
    program the run uses. An array spread over other processes' devices, which the runtime
    cannot copy from this one, is still copied by ``jnp.copy``.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(3.0)
    >>> y = copy_arrays({"x": x, "name": "kept"})
    >>> y["x"].tolist(), y["name"], y["x"].unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    ([0.0, 1.0, 2.0], 'kept', True)
    """
    return jax.tree_util.tree_map(_copy_array, tree)


def _copy_array(x: Any) -> Any:
    if not eqx.is_array(x):
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable:
        return jax.device_put(x, may_alias=False)
    return jnp.copy(x)


def place(tree: Any, sharding: Any) -> Any:
    """Put every array leaf of ``tree`` on ``sharding``; other leaves (static) stay as they are.

    (``jax.device_put`` on a whole module would turn Python scalars into arrays and so change
    what the executor treats as static.)
    """
    if sharding is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree)
