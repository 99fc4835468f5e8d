"""Shared test settings: the hypothesis profile, a fixture computed once per run, a
tree-tolerance helper, and the train step the packed-layout tests compare."""

import fcntl
import json
import os

import jax
import numpy as np
from hypothesis import settings

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, database=None,
                          print_blob=True)
settings.register_profile("dev", max_examples=60, deadline=None, derandomize=True, database=None,
                          print_blob=True)
# "ci" (15 examples) by default, sized for a 2-core CI run; HYPOTHESIS_PROFILE=dev searches 4x
# deeper (60 examples) when changing the code a property covers.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def run_once(tmp_path_factory, name, compute):
    """``compute()`` (a JSON value) once per test run, shared by every xdist worker.

    A module-scoped fixture runs again on each worker that gets one of its tests (``pytest -n``
    spreads them one by one). Computed under a lock in the run's shared temporary folder, the
    first worker's result is read by the others (xdist's documented way to run a fixture
    once; without xdist it is an ordinary call)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                   # the folder every worker's basetemp sits in
    path = root / f"run-once-{name}.json"
    with open(root / f"run-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-5):
    """Every leaf of two pytrees equal within tolerance, with the leaf's path on failure."""
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    assert a_tree == e_tree, f"tree structures differ: {a_tree} vs {e_tree}"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"leaf {jax.tree_util.keystr(path)}")


def train_step(case):
    """``case(p, *args) -> (loss, out)`` as one call giving its loss, outputs and gradients."""
    def fn(p, *args):
        (loss, out), grads = jax.value_and_grad(case, has_aux=True)(p, *args)
        return {"loss": loss, "out": out, "grad": grads}
    fn.__name__ = case.__name__
    return fn


def packed_and_padded(case, specs, buckets):
    """`train_step` of ``case`` through polyexec packed and padded (strict: never a
    fallback)."""
    import polyexec as px
    return tuple(px.bucketed(train_step(case), specs, buckets=buckets, layout=layout,
                             strict=True) for layout in ("pack", "pad"))

