"""Pure train/eval step functions and their bucketed, compiled-per-bucket versions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import Bucketed, LengthVar, Spec, bucketed
from .._errors import OptionError
from ._state import TrainState

# Loss functions see a padded batch: tokens (B, T) and the real lengths (B,).
LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
EvalFn = Callable[[Any, jax.Array, jax.Array], "tuple[jax.Array, jax.Array]"]


def train_step_fn(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                  return_grads: bool = False):
    """The pure train step ``(state, tokens, lengths) -> (new_state, metrics)``.

    ``jax.value_and_grad`` of ``loss_fn(model, tokens, lengths)`` with respect to the model's
    floating-point arrays, then ``optimizer.update`` and ``optax.apply_updates``. ``metrics``
    holds ``loss`` and ``grad_norm`` (and ``grads`` with ``return_grads``). It knows no sizes:
    `make_train_step` compiles it once per length bucket; ``jax.jit`` of it is the exact-shape
    reference the tests compare against.

    >>> import equinox as eqx, jax, jax.numpy as jnp, optax
    >>> from polyexec.training import TrainState, train_step_fn
    >>> def loss(model, tokens, lengths):
    ...     return jnp.mean(jax.vmap(model)(tokens.astype(jnp.float32)) ** 2)
    >>> model = eqx.nn.Linear(3, 1, key=jax.random.PRNGKey(0))
    >>> step = train_step_fn(loss, optax.sgd(0.1))
    >>> state, metrics = step(TrainState.create(model, optax.sgd(0.1)), jnp.ones((2, 3)), jnp.full(2, 3))
    >>> int(state.step), metrics["loss"].shape
    (1, ())
    """

    def train_step(state: TrainState, tokens, lengths):
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def loss_of(p):
            return loss_fn(eqx.combine(p, static), tokens, lengths)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.combine(optax.apply_updates(params, updates), static)
        # The global L2 norm (optax.global_norm is deprecated, its successor needs optax>=0.2.5).
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if return_grads:
            metrics["grads"] = grads
        return TrainState(model=model, opt_state=opt_state, step=state.step + 1), metrics

    return train_step


def eval_step_fn(loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None):
    """The pure eval step ``(model, tokens, lengths) -> (total, count)``.

    With ``eval_fn`` (returning a summed loss and the number of terms it sums, e.g. predicted
    tokens) averages across batches are exact. Without it, ``loss_fn``'s mean is weighted by
    the batch's real tokens, ``sum(lengths)``.
    """
    if eval_fn is not None:
        def eval_step(model, tokens, lengths):
            total, count = eval_fn(model, tokens, lengths)
            return jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32)
    elif loss_fn is not None:
        def eval_step(model, tokens, lengths):
            count = jnp.sum(lengths).astype(jnp.float32)
            return loss_fn(model, tokens, lengths).astype(jnp.float32) * count, count
    else:
        raise OptionError("eval_step_fn: expected loss_fn or eval_fn, received neither")
    return eval_step


def _bucketed_step(step: Callable, *, name: str, length_buckets: Sequence[int],
                   batch_buckets: Sequence[int], min_length: int, pad_id: int,
                   shardings: tuple | None, masking: bool,
                   donate_argnums: tuple[int, ...] = (), layout: str = "pad") -> Bucketed:
    """``step(state or model, tokens (B, T), lengths (B,))`` compiled once per (B, T) bucket.

    ``B`` and ``T`` are this step's own LengthVars, carried by its Specs and keyed in
    ``buckets``: the Specs resolve against them, never against a ``"T"`` defined elsewhere in
    the user's process. ``T >= min_length`` (2 by default) is a constraint of the one symbolic
    trace: next-token losses slice ``tokens[:, :-1]``, which needs T >= 2. ``lengths`` makes
    ``T`` ragged along ``B``: the loss sees each row at its own length (no mask needed).
    """
    T = LengthVar("T", min=min_length, max=max(length_buckets))
    # Packed, B counts sequences: as many as the largest grid holds of the shortest.
    B = LengthVar("B", max=max(batch_buckets) * (1 if layout == "pad" else T.max // min_length))
    batch = None if shardings is None else shardings[1]
    return bucketed(step, in_specs=(None, Spec((B, T), jnp.int32, pad=pad_id),
                                    Spec((B,), jnp.int32, lengths_of=T)),
                    buckets={T: list(length_buckets), B: list(batch_buckets)},
                    donate_argnums=donate_argnums, name=name, masking=masking, layout=layout,
                    in_shardings=None if shardings is None else (shardings[0], batch, batch))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    length_buckets: Sequence[int], batch_buckets: Sequence[int],
                    min_length: int = 2, pad_id: int = 0, shardings: tuple | None = None,
                    donate: bool = True,
                    return_grads: bool = False, masking: bool = True,
                    layout: str = "pad") -> Bucketed:
    """`train_step_fn` as a `px.bucketed` function, compiled once per (B, T) bucket.

    ``state`` is not length-polymorphic (its arrays keep their shapes) and is donated, so XLA
    updates the parameters and optimiser state in place. ``shardings`` = (state sharding, batch
    sharding) for data parallelism: parameters replicated, the batch axis split over a Mesh.
    ``masking=False`` turns off the executor's logical-length rewrite; ``layout`` is
    `px.bucketed`'s (``"auto"`` for `choose_layout`, which pins pad or pack by cost).

    >>> import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
    >>> from polyexec.training import TrainState, make_train_step
    >>> def loss(model, tokens, lengths):          # masked mean of a per-token score
    ...     mask = jnp.arange(tokens.shape[1]) < lengths[:, None]
    ...     scores = jax.vmap(jax.vmap(model))(tokens.astype(jnp.float32)[..., None])[..., 0]
    ...     return jnp.sum(jnp.where(mask, scores ** 2, 0)) / jnp.maximum(jnp.sum(mask), 1)
    >>> opt = optax.adam(1e-2)
    >>> step = make_train_step(loss, opt, length_buckets=[8, 16], batch_buckets=[4])
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), opt)
    >>> state, metrics = step(state, np.ones((4, 5), np.int32), np.array([5, 3, 2, 1], np.int32))
    >>> int(state.step), step.stats.compiles, step.plan.reshaping_is_impossible
    (1, 1, False)
    """
    return _bucketed_step(train_step_fn(loss_fn, optimizer, return_grads=return_grads),
                          name="train_step", length_buckets=length_buckets,
                          batch_buckets=batch_buckets, min_length=min_length, pad_id=pad_id,
                          shardings=shardings, masking=masking, layout=layout,
                          donate_argnums=(0,) if donate else ())


def make_eval_step(loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None, *,
                   length_buckets: Sequence[int], batch_buckets: Sequence[int],
                   min_length: int = 2, pad_id: int = 0, shardings: tuple | None = None,
                   masking: bool = True, layout: str = "pad") -> Bucketed:
    """`eval_step_fn` as a `px.bucketed` function: ``(model, tokens, lengths) -> (total, count)``."""
    return _bucketed_step(eval_step_fn(loss_fn, eval_fn), name="eval_step", layout=layout,
                          length_buckets=length_buckets, batch_buckets=batch_buckets,
                          min_length=min_length, pad_id=pad_id, shardings=shardings,
                          masking=masking)
