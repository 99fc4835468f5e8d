"""`px.trace`: the symbolic trace alone, with the full polymorphism check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._plan import Plan, flat_program, input_avals
from ._vars import Spec


def trace(fn: Callable, *args_or_specs: Any, buckets=None, check_sizes: bool = True) -> Plan:
    """Trace ``fn`` once over symbolic lengths and return its `Plan`, without compiling.

    Each argument is either a `Spec` (a length-polymorphic array) or a concrete value (a model,
    a constant: its arrays keep their shapes and are stored with the plan by `Plan.save`). With
    ``check_sizes`` the plan is also traced at two concrete sizes and compared, catching code
    that branches on a size (``if x.shape[1] == 1024``) although the symbolic trace passed.

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", min=2, max=512)
    >>> def bad(x):
    ...     return x * jnp.arange(512)[: x.shape[0]]
    >>> plan = px.trace(bad, px.Spec("T", jnp.float32))
    >>> plan.reshaping_is_impossible
    True
    """
    from ._executor import Bucketed

    in_specs = tuple(a if isinstance(a, Spec) else None for a in args_or_specs)
    runner = Bucketed(fn, in_specs, buckets=buckets, check_sizes=check_sizes,
                      name=getattr(fn, "__name__", None))
    fixed = [a for a in args_or_specs if not isinstance(a, Spec)]
    call = runner._example_call(fixed)
    plan = runner._trace(call.signature)
    if plan.reshaping_is_impossible:
        # A genuine bug fails at every concrete size: raise it rather than call it
        # non-polymorphic. Code written for the maximum (`x + jnp.zeros(1024)`, a reshape to a
        # literal size) fails at the smallest bucket but works at the largest: that is the
        # non-polymorphic case, so try both before deciding.
        smallest = {n: s[0] for n, s in runner.bucket_sizes.items()}
        largest = {n: s[-1] for n, s in runner.bucket_sizes.items()}
        for i, sizes in enumerate([smallest] if smallest == largest else [smallest, largest]):
            run = flat_program(fn, call.signature, [v.name for v in plan.variables], sizes,
                               runner._counter, [])
            try:
                jax.jit(run).trace(*input_avals(call.signature, plan.variables, sizes))
                break
            except Exception as e:
                first = first if i else e
        else:
            raise first
    plan.constants = tuple(call.arrays)
    return plan
