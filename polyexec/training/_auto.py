"""``buckets="auto"``: measure one compile and one step, then choose the bucket set by cost.

The cost model (`buckets.CostModel`) needs seconds per compile and seconds per padded cell.
Both come from the run's own step at its largest bucket -- a shape almost every run uses
anyway, so the measurement's compile is rarely wasted -- and `buckets.Auto.fit` picks the
(length x rows) set with the least predicted time for the epochs still to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import buckets as _buckets

from .. import Bucketed
from .._cache import count_compiles

# Beside JAX's persistent compile cache: what each program cost to compile and to run.
_COSTS = "polyexec-costs.json"


def measure_cost(step: Bucketed, arg: Any, tokens: Any, lengths: Any, *, runs: int = 2,
                 extra_compiles: Bucketed | None = None, extra_arg: Any = None,
                 parallel: int = 1) -> _buckets.CostModel:
    """Compile ``step`` at the shape of ``tokens`` (B, T) and time ``runs`` calls on copies of
    ``arg`` (the step may donate it); the fastest call gives the seconds per padded cell.

    ``extra_compiles``: a second step compiled at the same shape whose compile seconds are
    added (each length bucket compiles the eval step as well as the train step).
    ``parallel``: the other compiles will overlap this many ways (e.g. beside training on a
    background thread), so count this fraction of their seconds.

    With JAX's persistent compile cache on, the cost is kept beside it; when the program is
    then loaded from the cache (no compile to time), the kept cost is returned, so a second run
    of the same job chooses the same buckets and finds them all cached.

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
    shape = {"B": rows, "T": length}
    steps = [(step, arg)] + ([(extra_compiles, extra_arg)] if extra_compiles is not None else [])
    before = [f.stats.compile_seconds for f, _ in steps]
    with count_compiles() as events:
        for f, a in steps:
            f.warmup(a, sizes=[shape], max_workers=1)
    seconds = sum(f.stats.compile_seconds - b for (f, _), b in zip(steps, before))
    hit = events.cache_hits > 0
    record = _Record([f for f, _ in steps], shape)
    if hit and record.known is not None:
        # Loaded from the persistent cache: the load is no compile. The cost measured when it
        # was compiled stands in -- and so the same job chooses the same, cached, buckets.
        compile_s, per_cell = record.known
    else:
        fastest = float("inf")
        for _ in range(runs):
            fresh = jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, arg)
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            jax.block_until_ready(step(fresh, tokens, lengths))
            fastest = min(fastest, time.perf_counter() - start)
        compile_s, per_cell = seconds, fastest / (rows * length)
        if not hit:
            record.save(compile_s, per_cell)
    return _buckets.CostModel(compile_seconds=compile_s / parallel, seconds_per_cell=per_cell)


class _Record:
    """The cost measured for one program at one shape, kept beside JAX's persistent compile
    cache (when one is configured) in ``polyexec-costs.json``."""

    def __init__(self, steps: list[Bucketed], shape: dict):
        self.folder = jax.config.jax_compilation_cache_dir
        modules = [getattr(f.plan, "exported", None) for f in steps]
        self.key = None
        if self.folder and None not in modules:
            text = "".join(m.mlir_module() for m in modules) + repr(sorted(shape.items()))
            self.key = hashlib.sha256(text.encode()).hexdigest()

    @property
    def path(self) -> str:
        return os.path.join(self.folder, _COSTS)

    @property
    def known(self) -> tuple[float, float] | None:
        entry = self._read().get(self.key) if self.key else None
        return None if entry is None else (float(entry[0]), float(entry[1]))

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def save(self, compile_seconds: float, seconds_per_cell: float) -> None:
        if self.key is None:
            return
        table = {**self._read(), self.key: [compile_seconds, seconds_per_cell]}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(table, fh)
            os.replace(tmp, self.path)   # atomic: a concurrent reader sees old or new, whole
        except OSError:
            pass                         # a read-only cache still serves compiles


def agree(cost: _buckets.CostModel, processes: int) -> _buckets.CostModel:
    """Process 0's measurement on every process: each one times its own steps, and the bucket
    choice (hence every step's shape) must be the same everywhere."""
    if processes == 1:
        return cost
    values = multihost_utils.broadcast_one_to_all(
        np.array([cost.compile_seconds, cost.seconds_per_cell, cost.seconds_per_step]))
    return _buckets.CostModel(*(float(v) for v in np.asarray(values)))

