"""Every read of JAX's private API, in one place.

JAX promises nothing about ``jax._src`` or the private attributes of its symbolic dimensions:
any release may rename or reshape them. polyexec needs a few (nothing public evaluates a
symbolic dimension at concrete sizes, or says which line of user code made an equation), so
they are read here and nowhere else: when a JAX release breaks one, this module is the one to
mend (tests/test_architecture.py keeps it so). Each shim says what it reads and what public
API would replace it. What JAX offers publicly (``jax.export.is_symbolic_dim``,
``jax.extend.source_info_util``, ``jax.typeof``) is called where it is used, not wrapped here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax.lax
from jax import export
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import source_info_util as _source_info
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.export import shape_poly as _shape_poly
from jax._src.lax import control_flow as _control_flow
from jax._src.lax import convolution as _convolution
from jax._src.lax import lax as _lax
from jax._src.lax.control_flow import loops as _loops
from jax._src.numpy import hijax as _numpy_hijax

try:  # dead-code elimination is optional: without it the planner counts everything as live
    from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:
    _dce_jaxpr = None

# -- symbolic dimensions ------------------------------------------------------------------------

# What `int(T)` or an undecidable `T >= 5` raises. Not jax.errors.InconclusiveDimensionOperation
# (jax core's, an unrelated class), and jax.export does not name it.
InconclusiveDimension = _shape_poly.InconclusiveDimensionOperation

# What JAX raises when an operation it evaluates eagerly meets a symbolic size (a slice
# ``table[:T]`` under ``jax.ensure_compile_time_eval``, as equinox's RoPE cache does): the
# variable appears in no argument of the eager computation. jax.export does not name it.
UnexpectedDimVar = _shape_poly.UnexpectedDimVar

# The code of a symbolic dimension's `==` and `!=`, which the tracer's profile hook recognises
# to record comparisons JAX cannot decide (_trace._comparisons_recorded); JAX's methods are
# read, never replaced. No public API reports an undecided comparison.
DIM_EQ_CODE = _shape_poly._DimExpr.__eq__.__code__
DIM_NE_CODE = _shape_poly._DimExpr.__ne__.__code__
# The code of its ordered comparisons, by operator: a trace at a raised min records those of
# the user's code that the raise alone decides (_trace._comparisons_recorded).
DIM_ORDER_CODES = {_shape_poly._DimExpr.__ge__.__code__: ">=",
                   _shape_poly._DimExpr.__le__.__code__: "<=",
                   _shape_poly._DimExpr.__gt__.__code__: ">",
                   _shape_poly._DimExpr.__lt__.__code__: "<"}
_GEQ_DECISION_CODE = _shape_poly._geq_decision.__code__


def undecided_comparison(error: BaseException) -> tuple[Any, Any] | None:
    """``(e1 - e2, the frame that compared)`` of the ``e1 >= e2`` JAX could not decide when it
    raised ``error`` (`InconclusiveDimension`; ``T - 1 >= 1`` for ``x[:, 1:]`` at ``T >= 1``),
    or None. The comparing frame is the first one outside JAX's symbolic-dimension module (its
    ``__ge__``/``__lt__``... call the decision). Private: the message is the only public record
    of the comparison, and it holds the expressions as text."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _GEQ_DECISION_CODE:
        tb = tb.tb_next
    if tb is None:
        return None
    decision = tb.tb_frame
    e1, e2 = decision.f_locals.get("e1"), decision.f_locals.get("e2")
    caller = decision.f_back
    while caller is not None and caller.f_code.co_filename == _GEQ_DECISION_CODE.co_filename:
        caller = caller.f_back
    return e1 - e2, caller


def is_constant_dim(d) -> bool:
    """Whether ``d`` is a static integer (anything ``operator.index`` accepts, and not a
    traced value). ``jax.core.is_constant_dim`` is deprecated without a replacement;
    ``not jax.export.is_symbolic_dim(d)`` differs on tracers and non-dimensions."""
    # Said first without JAX's check, which raises and catches a TypeError for each symbolic
    # dimension: the rewrites ask some 40,000 times of the 12-layer LM's dimensions.
    if type(d) is int:
        return True
    if export.is_symbolic_dim(d):   # no ``__index__``: JAX's check answers False too
        return False
    return _core.is_constant_dim(d)


def dim_vars(d) -> set[str]:
    """The variables a dimension mentions; empty for an integer. Private (``_get_vars``);
    jax.export offers only the string, ``str(d)``."""
    return set(d._get_vars()) if export.is_symbolic_dim(d) else set()


def evaluate_dim(d, env: Mapping[str, Any]):
    """``d`` with each variable at ``env``'s value (ints, or arrays: then an array); an
    integer is returned as it is. Private (``_evaluate``): nothing public evaluates a symbolic
    dimension short of exporting and calling a program."""
    return d._evaluate(env) if export.is_symbolic_dim(d) else d


def var_dim(name: str, scope):
    """The dimension of the single variable ``name`` in ``scope``. Private
    (``_DimExpr._from_var``); ``jax.export.symbolic_shape(name, scope=scope)[0]`` parses a
    string instead, and fails on a variable named like an operation (``max``, ``mod``)."""
    return _shape_poly._DimExpr._from_var(name, scope)


def dim_bounds(d, *, sign_only: bool = False) -> tuple[float, float]:
    """``(lower, upper)`` bounds of a symbolic dimension as JAX's decision procedure finds
    them (infinite when unbounded). ``sign_only`` lets it stop once ``d >= 0`` or ``d < 0`` is
    decided: cheaper, and the bounds may then be loose. Private (``_bounds_decision``, looked
    up at each call: JAX installs it when its decision module loads); publicly only a
    comparison (``d >= 0``) can be asked, which raises when undecided."""
    precision = (_shape_poly.BoundsPrecision.FOR_GEQ0_OR_LT0 if sign_only
                 else _shape_poly.BoundsPrecision.BEST)
    return _shape_poly._bounds_decision(d, precision)


class Factor(NamedTuple):
    """A factor of a term of a dimension: a variable (``var``), or ``operation`` -- JAX's
    "floordiv", "mod", "max" or "min" -- applied to ``operands`` (dimensions or ints)."""

    var: str | None
    operation: str | None
    operands: Sequence[Any]


def terms(d) -> list[tuple[int, tuple[tuple[Factor, int], ...]]]:
    """A symbolic dimension as JAX normalises it: a sum of ``coeff * f1**p1 * f2**p2 ...``,
    one ``(coeff, ((factor, power), ...))`` per term; the constant term has no factors.
    Private (``_sorted_terms``, ``_factors``): no public API shows an expression's structure,
    which the monotonicity proof of the logical rewrite reads."""
    return [(coeff, tuple((Factor(f.var, f.operation, f.operands), power)
                          for f, power in term._factors))
            for term, coeff in d._sorted_terms]


def dim_as_value(d):
    """A dimension as a JAX value (an int stays an int; a symbolic one becomes the size in
    the program being traced). Private (``core.dimension_as_value``): no
    public function turns a dimension into a value."""
    return _core.dimension_as_value(d)


def definitely_equal(a, b) -> bool:
    """Whether two dimensions are equal at every size (False when JAX cannot decide).
    Private (``core.definitely_equal``); publicly ``a == b``, which answers False both for
    "different" and "undecided" and so cannot be told from it."""
    return _core.definitely_equal(a, b)


def definitely_equal_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """`definitely_equal` for every axis of two shapes of the same rank."""
    return _core.definitely_equal_shape(a, b)


# -- values, programs, the backend ----------------------------------------------------------------


def convert_element_type(x, dtype, weak_type: bool):
    """``x`` as ``dtype`` with the given weak type (a scan carry must keep its exact type).
    Private (``lax._convert_element_type``); ``lax.convert_element_type`` always makes a
    strong type."""
    return _lax._convert_element_type(x, dtype, weak_type)


def dce_jaxpr(jaxpr) -> tuple[Any, list[bool]] | None:
    """``(jaxpr without the equations no output needs, which inputs are used)``, or None where
    this JAX lacks it. Private (``partial_eval.dce_jaxpr``); no public dead-code elimination
    of a jaxpr exists."""
    if _dce_jaxpr is None:
        return None
    return _dce_jaxpr(jaxpr, True, instantiate=False)


def jax_user_frames(traceback) -> Iterator[Any]:
    """The frames of an equation's traceback (``eqn.source_info.traceback``) that JAX counts
    as user code, innermost first, each with ``file_name`` and ``start_line``: all but JAX's
    own files, the standard library's and those excluded with ``register_exclusion`` (other
    libraries count). Private (``source_info_util.user_frames``);
    ``jax.extend.source_info_util`` has no reader of a traceback."""
    return _source_info.user_frames(traceback)


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (then ``jax.distributed`` can no longer join a
    cluster). Private (``xla_bridge``): every public query (``jax.devices()``) starts them."""
    return _xla_bridge.backends_are_initialized()


# -- forms of JAX's functions for symbolic lengths ------------------------------------------------


def bind_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                              rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                              batch_group_count=1, precision=None, preferred_element_type=None,
                              out_sharding=None):
    """``lax.conv_general_dilated`` with its padding taken as given, symbolic dimensions
    included: what JAX's function does after it checks the padding with ``operator.index``
    (which refuses a symbolic dimension although the primitive's shape rule and lowering take
    one, as its own ``"SAME"`` padding makes them). Private (the primitive and JAX's
    canonicalisations of its parameters); no public function binds a primitive."""
    dnums = _convolution.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    out_sharding = _convolution.canonicalize_sharding(out_sharding, "dot_general")
    if lhs_dilation is None:
        lhs_dilation = (1,) * (lhs.ndim - 2)
    if rhs_dilation is None:
        rhs_dilation = (1,) * (rhs.ndim - 2)
    padding = tuple((lo if export.is_symbolic_dim(lo) else operator.index(lo),
                     hi if export.is_symbolic_dim(hi) else operator.index(hi))
                    for lo, hi in padding)
    if preferred_element_type is not None:
        preferred_element_type = _dtypes.check_and_canonicalize_user_dtype(
            preferred_element_type, "conv_general_dilated")
    lhs, rhs = _core.auto_insert_reshard(lhs, rhs)
    return _convolution.conv_general_dilated_p.bind(
        lhs, rhs, window_strides=tuple(window_strides), padding=padding,
        lhs_dilation=tuple(lhs_dilation), rhs_dilation=tuple(rhs_dilation),
        dimension_numbers=dnums, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count, precision=_lax.canonicalize_precision(precision),
        preferred_element_type=preferred_element_type, out_sharding=out_sharding)


# The ``longest`` of the concrete trace this thread runs for `polyexec._recover` (0: none), as
# a JAX option in the trace context: jax.jit caches what a helper traces in it apart from its
# plain calls, which must get JAX's own functions. Only concrete traces set it: a symbolic
# trace's shapes never meet a plain call's, and keyed, a partitioned plan's segments would miss
# JAX's cache and trace the user's function again. Private (``config.int_state``).
concrete_forms = _config.int_state(
    "jax_polyexec_concrete_forms", 0,
    "polyexec: the longest size of the concrete trace this thread runs (0: none)",
    include_in_trace_context=True)


def install_symbolic_forms(*, prefix_scan, fori_as_scan, prod_jvp, conv_padding,
                           search_by_counting) -> None:
    """Install `polyexec._forms`' replacements where JAX and users look the functions up:
    ``associative_scan`` in ``jax.lax`` and in JAX's loop module (whose cumulative reductions'
    derivatives call it), ``fori_loop`` in ``jax.lax`` and JAX's control-flow package (which
    ``jnp`` calls), ``reduce_prod``'s derivative rule, and ``conv_general_dilated`` in
    ``jax.lax`` and JAX's convolution module (whose transposes and batching rule call it with
    a padding that depends on the length: a stride, SAME with a stride, as equinox's ``Conv``
    computes it), and the implementation behind ``jnp.searchsorted`` in JAX's ``hijax``
    module (which ``jnp.digitize`` calls too). Each replacement calls JAX's original unless
    polyexec is tracing in that thread over a symbolic length. Once per process (each
    replacement is marked ``polyexec_form``); the originals stay reachable as ``__wrapped__``.
    Private (module attributes of ``jax._src``, ``ad.primitive_jvps``): JAX has no public hook
    for any of them."""
    if getattr(_loops.associative_scan, "polyexec_form", False):
        return
    scan = prefix_scan(_loops.associative_scan)
    loop = fori_as_scan(_loops.fori_loop)
    for module in (jax.lax, _control_flow, _loops):
        module.associative_scan = scan
        module.fori_loop = loop
    _ad.primitive_jvps[_lax.reduce_prod_p] = prod_jvp(_ad.primitive_jvps[_lax.reduce_prod_p],
                                                      _lax.reduce_prod_p.bind)
    conv = conv_padding(_convolution.conv_general_dilated, bind_conv_general_dilated)
    jax.lax.conv_general_dilated = _convolution.conv_general_dilated = conv
    _numpy_hijax.searchsorted_via_expand = search_by_counting(
        _numpy_hijax.searchsorted_via_expand, _numpy_hijax._searchsorted_impl)
