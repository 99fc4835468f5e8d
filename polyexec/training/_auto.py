"""``buckets="auto"``: measure one compile and one step, then choose the bucket set by cost.

The cost model (`buckets.CostModel`) needs seconds per compile and seconds per padded cell.
Both come from the run's own step at its largest bucket -- a shape almost every run uses
anyway, so the measurement's compile is rarely wasted -- and `buckets.Auto.fit` picks the
(length x rows) set with the least predicted time for the epochs still to run.
"""

from __future__ import annotations

import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import buckets as _buckets

from .. import Bucketed


def measure_cost(step: Bucketed, arg: Any, tokens: Any, lengths: Any, *, runs: int = 2,
                 extra_compiles: Bucketed | None = None, extra_arg: Any = None,
                 parallel: int = 1) -> _buckets.CostModel:
    """Compile ``step`` at the shape of ``tokens`` (B, T) and time ``runs`` calls on copies of
    ``arg`` (the step may donate it); the fastest call gives the seconds per padded cell.

    ``extra_compiles``: a second step compiled at the same shape whose compile seconds are
    added (each length bucket compiles the eval step as well as the train step).
    ``parallel``: compiles that will run this many at a time (warmup threads on as many cores)
    cost this fraction of their seconds in wall time: XLA's CPU compile of one program keeps
    about one core busy.

    >>> import equinox as eqx, jax, numpy as np, optax
    >>> from polyexec.training import TrainState, make_train_step, measure_cost
    >>> loss = lambda model, tokens, lengths: jax.numpy.mean(tokens * model.weight[0, 0])
    >>> step = make_train_step(loss, optax.sgd(0.1), length_buckets=[16], batch_buckets=[4])
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))
    >>> cost = measure_cost(step, state, np.zeros((4, 16), np.int32), np.full(4, 16, np.int32))
    >>> cost.compile_seconds > 0 and cost.seconds_per_cell > 0, step.stats.compiles
    (True, 1)
    """
    rows, length = tokens.shape
    shape = [{"B": rows, "T": length}]

    def compile_seconds(f: Bucketed, a: Any) -> float:
        before = f.stats.compile_seconds
        f.warmup(a, sizes=shape, max_workers=1)
        return f.stats.compile_seconds - before

    seconds = compile_seconds(step, arg)
    if extra_compiles is not None:
        seconds += compile_seconds(extra_compiles, extra_arg)
    fastest = float("inf")
    for _ in range(runs):
        fresh = jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, arg)
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        jax.block_until_ready(step(fresh, tokens, lengths))
        fastest = min(fastest, time.perf_counter() - start)
    return _buckets.CostModel(compile_seconds=seconds / parallel,
                              seconds_per_cell=fastest / (rows * length))


def agree(cost: _buckets.CostModel, processes: int) -> _buckets.CostModel:
    """Process 0's measurement on every process: each one times its own steps, and the bucket
    choice (hence every step's shape) must be the same everywhere."""
    if processes == 1:
        return cost
    from jax.experimental import multihost_utils
    values = multihost_utils.broadcast_one_to_all(
        np.array([cost.compile_seconds, cost.seconds_per_cell, cost.seconds_per_step]))
    return _buckets.CostModel(*(float(v) for v in np.asarray(values)))
