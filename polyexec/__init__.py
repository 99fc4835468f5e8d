"""polyexec: write a sequence model once over symbolic lengths; run it compiled per length bucket.

>>> import jax.numpy as jnp, numpy as np, polyexec as px
>>> T = px.LengthVar("T", min=1, max=1024)
>>> B = px.LengthVar("B", max=64)
>>> def masked_sum(x, lengths):                      # x: (B, T), lengths: (B,)
...     mask = px.sequence_mask(lengths, x, axis=1)
...     return jnp.sum(jnp.where(mask, x, 0.0), axis=1)
>>> f = px.bucketed(masked_sum,
...                 in_specs=(px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T")),
...                 out_specs=px.Spec("B"))
>>> f(np.ones((3, 100), np.float32), np.array([100, 7, 0])).tolist()
[100.0, 7.0, 0.0]
>>> f.plan.reshaping_is_impossible
False

The private modules are the pipeline's stages, each importing only the ones before it:
``_errors`` -> ``_spec`` (LengthVar, Spec, what names mean) -> ``_bind`` (validate arguments,
read sizes, pad) -> ``_convention`` (the one order of a program's flat inputs) -> ``_context``
/ ``_ops`` / ``_dynamic`` (what a traced function may call) -> ``_forms`` (JAX functions that
refuse a symbolic length, in forms it traces) -> ``_trace`` (the one symbolic trace) ->
``_recover`` (where that trace fails, a few concrete traces with the length axes recovered:
one symbolic program again) -> ``_logical`` (rewrite to logical lengths) -> ``_serialize``
(plan files) -> ``_plan`` (the plan value: segments and verdict) -> ``_planner`` (tracing a
function into its plan; `trace`) -> ``_cache`` (compile accounting, persistent cache) ->
``_executor`` (`bucketed`: caches and runs). Beneath them all, ``_jax_internals`` is the one module that reads JAX's
private API (``jax._src``, private attributes of symbolic dimensions), for any stage.

Beside the executor, for code that pads or measures on its own (``polyexec.training``, the
benchmark): ``px.pad_to(array, shape, fill)`` is the executor's host-side padder, and
``with px.count_compiles() as events:`` counts XLA compiles and persistent-cache hits and
writes while its block runs (nothing listens to ``jax.monitoring`` outside such a block).

>>> px.pad_to(np.array([[1, 2]]), (2, 3), fill=0).tolist()
[[1, 2, 0], [0, 0, 0]]
"""

from ._bind import pad_to
from ._cache import (CompileCounts, CompileEvents, count_compiles, disable_persistent_cache,
                     enable_persistent_cache, forbid_compiles)
from ._context import max_length, valid_length
from ._dynamic import compact, loop_until, nonzero, partition
from ._errors import (CompileError, LengthOverflowError, OptionError, PolyexecError,
                      PolymorphismError, SpecError)
from ._executor import Bucketed, BucketStats, Stats, bucketed
from ._logical import register_rule
from ._ops import arange_like, broadcast_like, reshape_like, sequence_mask
from ._plan import CutPoint, Intermediate, Plan, Segment, Verdict
from ._planner import trace
from ._spec import LengthVar, Spec

__all__ = [
    "LengthVar", "Spec", "bucketed", "Bucketed", "trace", "Plan", "Intermediate",
    "Stats", "BucketStats", "valid_length", "max_length", "sequence_mask", "reshape_like",
    "broadcast_like", "arange_like", "forbid_compiles", "enable_persistent_cache",
    "disable_persistent_cache", "PolyexecError", "SpecError", "OptionError",
    "LengthOverflowError", "PolymorphismError", "CompileError", "compact", "nonzero",
    "loop_until", "partition", "Segment", "CutPoint", "Verdict", "register_rule",
    "count_compiles", "CompileEvents", "CompileCounts", "pad_to",
]
