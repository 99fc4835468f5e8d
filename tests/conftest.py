"""Shared test settings: the hypothesis profile, xdist grouping, and a tree-tolerance helper."""

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


def pytest_configure(config):
    # Under `-n N` (xdist's default "load" distribution) a module-scoped fixture runs again on
    # every worker that gets one of its tests. Tests that share an expensive fixture carry
    # @pytest.mark.xdist_group(name) and then run on one worker, computing it once; tests
    # without the mark are still spread one by one ("loadgroup" is "load" for them).
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-5):
    """Every leaf of two pytrees equal within tolerance, with the leaf's path on failure."""
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    assert a_tree == e_tree, f"tree structures differ: {a_tree} vs {e_tree}"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"leaf {jax.tree_util.keystr(path)}")
