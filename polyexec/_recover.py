"""Stage 3b, recover: concrete traces with the length axes recovered.

Some code cannot be traced by JAX at a symbolic length although ``jax.jit`` runs it at any
concrete one: equinox's ``RotaryPositionalEmbedding`` reads ``float(T)`` and slices its cos/sin
table under ``jax.ensure_compile_time_eval``; ``jnp.arange(1, T + 1.0)`` needs a concrete
float; ``jnp.convolve`` compares the lengths of its operands. The symbolic trace (`_trace`)
then gives `Failed`, and without this stage each bucket would be retraced and run over its
padding as written.

`recover` traces the function at a small fixed number of concrete sizes instead
(`CONCRETE_TRACES`: each variable at its max, at its min and in between, all variables moving
together), checks that the programs are the same equation by equation (sub-programs included:
jit, scan, while, cond, custom_jvp/vjp calls) and reads every integer that differs between
them -- a shape, a slice limit, an iota's size, a scan's length, a literal -- as ``a * V + b``
(or ``a * V * W + b``) of the lengths, fitted on two traces and verified on the third. A
constant that differs is a value computed from the length where it is a scalar that fits, or a
slice of the max-size constant where its smaller versions are prefixes of it (RoPE's table);
anything else that differs is refused. The program is then rebuilt over JAX's symbolic
dimensions -- each equation of the max-size trace bound again with its recovered parameters
under ``jax.jit(...).trace(symbolic avals)``, each result's shape checked at every traced size
-- and handed on as an ordinary `Traced`: the logical rewrite and ``jax.export`` take it as
they take any symbolic trace. Where anything does not fit, the original `Failed` stands, its
reason saying what differed.

Why it is safe: no number is guessed -- each one that differs is explained by a fit verified
at a size it was not fitted on, and the min and the max are traced, so a branch on a size
anywhere in between changes the program and is refused. The size between is divisible by many
small numbers (`_middle`), so a branch on a size's divisibility (``T % 5 == 0``) is refused
too; one true at none of the sizes traced (``T % 7 == 0`` from 64, 60 and 3) is not seen. A
branch of the user's own code on a length (``if x.shape[0] > 8``) is never recovered, whatever
the traces show (`recoverable`). Below the three sizes, each size down to the declared min is
traced too and kept while the same program explains it; a ragged row shorter than the least
kept is refused at the call (a `RowFloor`).

>>> import jax.numpy as jnp, polyexec as px
>>> T = px.LengthVar("T", min=1, max=64)
>>> plan = px.trace(lambda x: x / jnp.arange(1, x.shape[0] + 1.0), px.Spec("T", jnp.float32))
>>> plan.reshaping_is_impossible, plan.padding_safe
(False, True)
>>> [str(a.shape[0]) for a in plan.jaxpr.out_avals]
['T']
"""

from __future__ import annotations

import dataclasses
import fractions
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax.extend import source_info_util

from ._context import describe_frame, user_frame
from ._convention import Convention
from ._jax_internals import convert_element_type, dim_as_value
from ._logical import RowFloor
from ._spec import symbolic_dims
from ._forms import concrete_trace
from ._trace import (Failed, RaisedMin, TraceCounter, Traced, concrete_jaxpr, evaluate_shape,
                     fmt_sizes, trace_program, where)



# Concrete traces per recovery: each variable at its max, between, and at its min.
CONCRETE_TRACES = 3
# The least size a program is recovered from: JAX writes a program differently at a unit
# axis (broadcasting, vmap's batching rules of a batch of 1), the same computation in other
# equations, so fitting a trace at 1 would refuse many programs. The sizes below it are traced
# only to verify the program (`_verified_below`).
LOWEST = 3

# Call-like primitives whose body is evaluated in place: calling a jaxpr inside a jitted one
# is what XLA inlines anyway, and a custom derivative rule has been applied already where the
# user's function differentiates (the traced program is a primal program).
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
            "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
            "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}
# Primitives bound again with their sub-programs rebuilt over the symbolic sizes.
_REBOUND = {"scan", "while", "cond"}


class Unrecoverable(Exception):
    """What differs between the concrete traces that no fit explains (and where)."""


def recoverable(failed: Failed) -> bool:
    """Whether concrete traces may stand in for a failed symbolic trace: not for a size the
    user asked for (`px.max_length`), a branch on ``==`` (JAX answers False), nor a branch of
    the user's own code on a length (`Failed.recoverable`, set by `_trace`); not where a raised
    min may decide the comparison (the planner tries that first)."""
    return failed.recoverable and failed.raise_min is None and not failed.split_sizes


# -- the sizes traced ---------------------------------------------------------------------------


def sample_sizes(variables: Sequence[Any]) -> list[dict[str, int]] | None:
    """The concrete sizes traced, max first (a cache filled at the max is sliced by the
    smaller traces, as equinox's RoPE table is): per variable its max, a size between, and
    its min (at least `LOWEST`); the middle sizes chosen (`_middle`) so that no two fitted
    terms (``T``, ``B``, ``B * T``) are affinely related over the traces. None when a variable
    has too few sizes."""
    lows = {v.name: max(v.min, LOWEST) for v in variables}
    highs = {v.name: v.max for v in variables}
    if any(highs[n] - lows[n] < 2 for n in lows):
        return None
    mids = {n: _middle(lows[n], highs[n]) for n in lows}
    if any(mids[n] >= highs[n] for n in mids):
        return None
    # Every other variable takes its min before its middle size: a number that grows with one
    # variable cannot then fit an affine form of another, which moves the other way.
    order = {n: i % 2 for i, n in enumerate(sorted(lows))}
    for _ in range(16):
        samples = [dict(highs), {n: (mids, lows)[order[n]][n] for n in lows},
                   {n: (lows, mids)[order[n]][n] for n in lows}]
        related = _related_terms(samples)
        if related is None:
            return samples
        n = related[-1]
        if mids[n] + 1 >= highs[n]:
            return None
        mids[n] += 1
    return None


def _middle(low: int, high: int) -> int:
    """The size traced between ``low`` and ``high``: of another parity than both where they
    share one, and divisible by as many small numbers as the range allows (60 between 3 and
    64). A branch on a size that no threshold decides -- ``T % 5 == 0``, an even length --
    changes the program at such a size, which the other traces then do not match: refused,
    where sizes that all missed it would recover one branch's program for every length."""
    first, target = low + (2 if high - low > 2 else 1), low + (high - low) // 3
    near = {max(first, min(high - 1, round(target / q) * q + d))
            for q in (2520, 720, 360, 240, 120, 60, 24, 12, 6, 2, 315, 45, 15, 3, 1)
            for d in (-q, 0, q)}
    if low % 2 == high % 2 and any(m % 2 != low % 2 for m in near):
        near = {m for m in near if m % 2 != low % 2}
    return max(sorted(near), key=lambda m: (sum(m % k == 0 for k in range(2, 17)),
                                            -abs(m - target)))


def _terms(names: Sequence[str]) -> list[tuple[str, ...]]:
    """What an integer of the program may be a multiple of (plus a constant): a variable, or
    the product of two (a (B, T) array flattened). Not a square: the fewer forms, the fewer
    that three traces could fit by coincidence."""
    return [(n,) for n in names] + list(itertools.combinations(names, 2))


def _related_terms(samples: Sequence[Mapping[str, int]]) -> tuple[str, ...] | None:
    """A term whose values over the traces are an affine function of another's (its
    variables), or None."""
    terms = _terms(sorted(samples[0]))
    vectors = {t: [math.prod(s[n] for n in t) for s in samples] for t in terms}
    for t, u in itertools.combinations(terms, 2):
        x, y = vectors[t], vectors[u]
        if len(set(x)) < len(x) or len(set(y)) < len(y):
            return t if len(set(x)) < len(x) else u
        a = fractions.Fraction(y[1] - y[0], x[1] - x[0])
        if all(a * (xi - x[0]) + y[0] == yi for xi, yi in zip(x, y)):
            return u
    return None


# -- fits ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Affine:
    """An integer as a function of the lengths: ``coeff * prod(term) + offset``."""

    coeff: int
    term: tuple[str, ...]
    offset: int

    def at(self, sizes: Mapping[str, int]) -> int:
        return self.coeff * math.prod(sizes[n] for n in self.term) + self.offset

    def symbolic(self, dims: Mapping[str, Any]):
        if not self.term or self.coeff == 0:
            return self.offset
        x = dims[self.term[0]]
        for n in self.term[1:]:
            x = x * dims[n]
        return self.coeff * x + self.offset

    def __str__(self) -> str:
        return f"{self.coeff}*{'*'.join(self.term)} + {self.offset}" if self.term else str(self.offset)


def fit(values: Sequence[Any], samples: Sequence[Mapping[str, int]]) -> Affine | None:
    """The one affine form of the lengths taking ``values`` at ``samples`` (integral
    coefficients, fitted on the first two traces and verified on every other), or None."""
    if not all(float(v) == int(v) for v in values):
        return None
    ys = [int(v) for v in values]
    if len(set(ys)) == 1:
        return Affine(0, (), ys[0])
    found = []
    for term in _terms(sorted(samples[0])):
        xs = [math.prod(s[n] for n in term) for s in samples]
        if xs[0] == xs[1]:
            continue
        a = fractions.Fraction(ys[1] - ys[0], xs[1] - xs[0])
        b = ys[0] - a * xs[0]
        if a.denominator == 1 and a != 0 and all(a * x + b == y for x, y in zip(xs, ys)):
            found.append(Affine(int(a), term, int(b)))
    return found[0] if len(found) == 1 else None


def _fit_or_raise(values, samples, what: str) -> Affine:
    found = fit(values, samples)
    if found is None:
        raise Unrecoverable(f"{what} is {', '.join(str(v) for v in values)} at "
                            f"{'; '.join(fmt_sizes(s) for s in samples)}, which no "
                            f"a * length + b explains")
    return found


# -- comparing the traces -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Aval:
    """An abstract value's recovered shape (a fit per axis)."""

    shape: tuple[Affine, ...]
    dtype: Any
    weak_type: bool

    def struct(self, dims):
        return jax.ShapeDtypeStruct(tuple(d.symbolic(dims) for d in self.shape), self.dtype,
                                    weak_type=self.weak_type)


@dataclasses.dataclass(frozen=True)
class _Const:
    """How a constant of the program is made at symbolic sizes: ``kind`` "same" (the max-size
    value), "scalar" (``fit`` of the lengths, as ``dtype``), "prefix" (the max-size value
    sliced to ``shape``)."""

    kind: str
    value: Any
    dtype: Any = None
    weak_type: bool = False
    fit: Affine | None = None
    shape: tuple[Affine, ...] = ()

    def build(self, dims):
        if self.kind == "same":
            return self.value
        if self.kind == "scalar":
            return convert_element_type(dim_as_value(self.fit.symbolic(dims)), self.dtype,
                                        self.weak_type)
        limits = tuple(d.symbolic(dims) for d in self.shape)
        return jax.lax.slice(jax.numpy.asarray(self.value), (0,) * len(limits), limits)


@dataclasses.dataclass(frozen=True)
class _Seq:
    """A parameter that is a tuple or list holding something recovered."""

    kind: type
    items: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Sub:
    """A sub-program: its recovered program and whether the parameter held it closed."""

    program: "_Program"
    closed: bool


@dataclasses.dataclass(frozen=True)
class _Eqn:
    eqn: Any                                # the max-size trace's equation
    params: Mapping[str, Any]
    # Operand position -> its constant: a literal, or a constant of the closed program, read
    # per use (JAX shares one constant between uses where the value is the same object, as
    # a full-length slice of a cached table is, and not where it is not).
    literals: Mapping[int, _Const]
    outs: tuple[tuple[tuple[int, ...], ...], ...]   # per output, its shape in each trace


@dataclasses.dataclass(frozen=True)
class _Program:
    jaxpr: Any                              # the max-size trace's jaxpr
    invars: tuple[_Aval, ...]
    outs: Mapping[int, _Const]              # outputs that are constants or literals
    eqns: tuple[_Eqn, ...]


def _wiring(jaxpr) -> list:
    """The program's equations as primitive names and variable numbers: equal for programs
    of the same structure."""
    number: dict[int, Any] = {}
    count = itertools.count()

    def name(v):
        if isinstance(v, jax.extend.core.Literal):
            return "lit"
        if isinstance(v, jax.extend.core.DropVar):
            return "drop"
        if id(v) not in number:
            number[id(v)] = next(count)
        return number[id(v)]

    for v in jaxpr.constvars:
        number[id(v)] = "const"
    for v in jaxpr.invars:
        name(v)
    out = [(eqn.primitive.name, tuple(name(v) for v in eqn.invars),
            tuple(name(v) for v in eqn.outvars)) for eqn in jaxpr.eqns]
    out.append(tuple(name(v) for v in jaxpr.outvars))
    return out


def _aval(avals: Sequence[Any], samples, what: str) -> _Aval:
    first = avals[0]
    if not all(hasattr(a, "shape") and a.dtype == first.dtype and len(a.shape) == len(first.shape)
               and getattr(a, "weak_type", False) == getattr(first, "weak_type", False)
               for a in avals):
        raise Unrecoverable(f"{what}: its type differs between sizes "
                            f"({', '.join(str(a) for a in avals)})")
    return _Aval(tuple(_fit_or_raise([a.shape[i] for a in avals], samples,
                                     f"{what}: axis {i}") for i in range(len(first.shape))),
                 first.dtype, bool(getattr(first, "weak_type", False)))


def _same_value(values) -> bool:
    first = values[0]
    try:
        if isinstance(first, (np.ndarray, jax.Array)) or hasattr(first, "__array__"):
            arrays = [np.asarray(v) for v in values]
            return all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype
                       and np.array_equal(a, arrays[0], equal_nan=a.dtype.kind in "fc")
                       for a in arrays)
        return all(type(v) is type(first) and (bool(v == first) or _both_nan(v, first))
                   for v in values)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def _both_nan(a, b) -> bool:
    """A NaN parameter (a gather's ``fill_value``) is the same NaN in every trace."""
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def _const(values, samples, what: str) -> _Const:
    """A constant of the program (a closed-over array, a literal) across the traces."""
    big = values[0]
    if _same_value(values):
        return _Const("same", big)
    arrays = [np.asarray(v) for v in values]
    if any(a.dtype != arrays[0].dtype or a.ndim != arrays[0].ndim for a in arrays):
        raise Unrecoverable(f"{what}: a constant whose type differs between sizes")
    weak = bool(getattr(getattr(big, "aval", None), "weak_type", False)) or isinstance(
        big, (int, float, complex))
    if arrays[0].ndim == 0:
        if arrays[0].dtype.kind not in "iuf":
            raise Unrecoverable(f"{what}: a constant {arrays[0].dtype} scalar that differs "
                                f"between sizes ({', '.join(str(a) for a in arrays)})")
        found = fit([a.item() for a in arrays], samples)
        if found is None or not all(
                np.asarray(found.at(s), a.dtype) == a for s, a in zip(samples, arrays)):
            raise Unrecoverable(f"{what}: a constant that is {', '.join(str(a) for a in arrays)} "
                                f"at {'; '.join(fmt_sizes(s) for s in samples)}, which no "
                                f"a * length + b explains")
        return _Const("scalar", big, arrays[0].dtype, weak, found)
    shape = tuple(_fit_or_raise([a.shape[i] for a in arrays], samples,
                                f"{what}: axis {i} of a constant")
                  for i in range(arrays[0].ndim))
    if any(d.coeff < 0 for d in shape) or not all(
            np.array_equal(a, arrays[0][tuple(slice(0, n) for n in a.shape)],
                           equal_nan=a.dtype.kind in "fc") for a in arrays[1:]):
        raise Unrecoverable(f"{what}: a constant of shape "
                            f"{', '.join(str(a.shape) for a in arrays)} at "
                            f"{'; '.join(fmt_sizes(s) for s in samples)} whose smaller "
                            f"versions are not prefixes of the one at the max")
    return _Const("prefix", big, shape=shape)


def _param(values, samples, what: str):
    first = values[0]
    closed = isinstance(first, jax.extend.core.ClosedJaxpr)
    if closed or isinstance(first, jax.extend.core.Jaxpr):
        if not all(type(v) is type(first) for v in values):
            raise Unrecoverable(f"{what}: differs between sizes")
        if not closed and len({str(v) for v in values}) == 1:
            return first     # no size in it (a scatter's combiner): kept as it is
        return _Sub(_program(values, samples, what.rsplit(": ", 2)[0]), closed)
    if isinstance(first, (bool, np.bool_)) or first is None:
        if _same_value(values):
            return first
        raise Unrecoverable(f"{what}: differs between sizes ({values})")
    if isinstance(first, (int, np.integer)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise Unrecoverable(f"{what}: differs between sizes ({values})")
        found = _fit_or_raise(values, samples, what)
        return first if not found.term else found
    if isinstance(first, (tuple, list)):
        if not all(type(v) is type(first) and len(v) == len(first) for v in values):
            raise Unrecoverable(f"{what}: differs between sizes")
        items = tuple(_param([v[i] for v in values], samples, what)
                      for i in range(len(first)))
        if all(item is first[i] for i, item in enumerate(items)):
            return first
        return _Seq(type(first), items)
    if _same_value(values):
        return first
    raise Unrecoverable(f"{what}: differs between sizes ({', '.join(map(str, values))})")


def _line(eqn, outer: str) -> str:
    """The user's line of an equation: its own, else the enclosing call's (JAX keeps no user
    frame for the equations inside a jitted jnp function)."""
    line = where(eqn)
    return outer if line == "<unknown>" else line


def _program(programs: Sequence[Any], samples, outer: str = "<unknown>") -> _Program:
    """The recovered form of the same program traced at each of ``samples``."""
    closed = isinstance(programs[0], jax.extend.core.ClosedJaxpr)
    jaxprs = [p.jaxpr if closed else p for p in programs]
    template = jaxprs[0]
    wiring = _wiring(template)
    for other, sizes in zip(jaxprs[1:], samples[1:]):
        theirs = _wiring(other)
        if theirs != wiring:
            culprit = next((i for i, (a, b) in enumerate(zip(wiring, theirs)) if a != b),
                           min(len(wiring), len(theirs)) - 1)
            at = _line(template.eqns[culprit], outer) if culprit < len(template.eqns) else outer
            ours = wiring[culprit] if culprit < len(template.eqns) else None
            mine = theirs[culprit] if culprit < len(theirs) - 1 else None
            what = (f"{ours[0]}'s operands differ" if ours and mine and ours[0] == mine[0]
                    else f"{mine[0] if mine else 'the outputs'} where the other has "
                         f"{ours[0] if ours else 'the outputs'}")
            agree = [fmt_sizes(s) for s, j in zip(samples, jaxprs)
                     if j is template or _wiring(j) == wiring]
            hint = (f"; the traces at {' and '.join(agree)} agree: a larger min of the length "
                    f"may let it recover" if sizes is samples[-1] and len(agree) > 1 else "")
            raise Unrecoverable(
                f"{at}: the program at {fmt_sizes(sizes)} differs from the one at "
                f"{fmt_sizes(samples[0])} ({what}): its structure depends on the size{hint}")
    invars = tuple(_aval([j.invars[i].aval for j in jaxprs], samples, f"input {i}")
                   for i in range(len(template.invars)))
    values = [dict(zip(j.constvars, p.consts)) if closed else {}
              for j, p in zip(jaxprs, programs)]

    def constants(operands: Sequence[Sequence[Any]], line: str) -> dict[int, _Const]:
        """Per operand position (one list per trace), the constant there, if any."""
        found = {}
        for i, v in enumerate(operands[0]):
            if isinstance(v, jax.extend.core.Literal):
                found[i] = _const([o[i].val for o in operands], samples, f"{line}: operand {i}")
            elif v in values[0]:
                found[i] = _const([vals[o[i]] for vals, o in zip(values, operands)], samples,
                                  f"{line}: operand {i} ({v.aval})")
        return found
    eqns = []
    for k, eqn in enumerate(template.eqns):
        at = [j.eqns[k] for j in jaxprs]
        line = f"{_line(eqn, outer)}: {eqn.primitive.name}"
        if set(eqn.params) != set().union(*(e.params for e in at)):
            raise Unrecoverable(f"{line}: its parameters differ between sizes")
        if eqn.primitive.name in _INLINED:
            key = _INLINED[eqn.primitive.name]
            params = {key: _param([e.params[key] for e in at], samples, f"{line}: {key}")}
        else:
            params = {name: _param([e.params[name] for e in at], samples, f"{line}: {name}")
                      for name in eqn.params}
        literals = constants([e.invars for e in at], line)
        outs = []
        for i, v in enumerate(eqn.outvars):
            _aval([e.outvars[i].aval for e in at], samples, f"{line}: output {i}")
            outs.append(tuple(tuple(e.outvars[i].aval.shape) for e in at))
        eqns.append(_Eqn(eqn, params, literals, tuple(outs)))
    return _Program(template, invars, outs=constants([j.outvars for j in jaxprs],
                                                     f"{outer}: an output"), eqns=tuple(eqns))


# -- rebuilding over symbolic sizes -------------------------------------------------------------


def _materialize(value, dims):
    if isinstance(value, Affine):
        return value.symbolic(dims)
    if isinstance(value, _Seq):
        items = [_materialize(v, dims) for v in value.items]
        return value.kind(*items) if hasattr(value.kind, "_fields") else value.kind(items)
    if isinstance(value, _Sub):
        return _subprogram(value, dims)
    return value


def _subprogram(sub: _Sub, dims):
    """A sub-program (a scan's body, a branch) traced again over the symbolic sizes."""
    program = sub.program

    def body(*args):
        return _evaluate(program, args, dims)

    closed = jax.make_jaxpr(body)(*(a.struct(dims) for a in program.invars))
    if closed.consts:
        raise Unrecoverable(f"a sub-program closes over {len(closed.consts)} constant(s) once "
                            f"rebuilt over symbolic sizes")
    return closed if sub.closed else closed.jaxpr


def _evaluate(program: _Program, args: Sequence[Any], dims,
              samples: Sequence[Mapping[str, int]] | None = None, outer: Any = None) -> list:
    """``program`` run on ``args`` (tracers of symbolic shape), each equation bound again
    with its recovered parameters at its own line; each result's shape, evaluated at every
    traced size, must be the shape that trace gave it."""
    jaxpr = program.jaxpr
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for step in program.eqns:
        eqn = step.eqn
        invals = [step.literals[i].build(dims) if i in step.literals else read(v)
                  for i, v in enumerate(eqn.invars)]
        # An equation inside a jitted jnp function has no user frame: it keeps the call's.
        traceback = eqn.source_info.traceback if outer is None or where(eqn) != "<unknown>" \
            else outer
        with source_info_util.user_context(traceback, name_stack=eqn.source_info.name_stack):
            if eqn.primitive.name in _INLINED:
                sub = step.params[_INLINED[eqn.primitive.name]].program
                outs = _evaluate(sub, invals, dims, samples, traceback)
            else:
                if eqn.primitive.name not in _REBOUND and any(
                        isinstance(v, _Sub) for v in step.params.values()):
                    raise Unrecoverable(f"{where(eqn)}: {eqn.primitive.name}: a sub-program "
                                        f"polyexec does not rebuild")
                params = {k: _materialize(v, dims) for k, v in step.params.items()}
                outs = eqn.primitive.bind(*invals, **params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if samples is not None:
            for out, shapes in zip(outs, step.outs):
                shape = jax.typeof(out).shape
                for sizes, want in zip(samples, shapes):
                    if evaluate_shape(shape, sizes) != want:
                        raise Unrecoverable(
                            f"{where(eqn)}: {eqn.primitive.name}: its result, rebuilt as "
                            f"{tuple(str(d) for d in shape)}, is {evaluate_shape(shape, sizes)} "
                            f"at {fmt_sizes(sizes)}, where the trace gave {want}")
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jax.extend.core.DropVar):
                env[v] = out
    return [program.outs[i].build(dims) if i in program.outs else read(v)
            for i, v in enumerate(jaxpr.outvars)]


# -- the stage ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What `recover` did: ``traced`` (the rebuilt program, or the `Failed` that stands, its
    reason extended by what differed) and the sizes it traced."""

    traced: Traced | Failed
    samples: tuple[Mapping[str, int], ...]


def recover(fn: Callable, convention: Convention, counter: TraceCounter,
            failed: Failed) -> Recovery:
    """The program of ``fn`` rebuilt over symbolic sizes from `CONCRETE_TRACES` concrete
    traces (`Traced`), or ``failed`` with what kept it from that. ``fn`` is the function
    `_trace.trace_symbolic` failed on; see the module's docstring."""
    variables = convention.variables
    rows = {by for _, by in convention.rows_at.values()}
    lengths = [v.name for v in variables if v.name not in rows]
    if len(lengths) > 1:
        # Three traces cannot tell two lengths' relation apart (max(T, S) fits T wherever
        # the traces have T >= S): one length variable, besides the rows, is recovered.
        return Recovery(dataclasses.replace(failed, reason=(
            f"{failed.reason} [not recovered from concrete traces: it has several length "
            f"variables ({', '.join(lengths)}), whose relations three traces cannot tell]")), ())
    samples = sample_sizes(variables)
    if samples is None:
        return Recovery(failed, ())

    def refused(why: str) -> Recovery:
        return Recovery(dataclasses.replace(failed, reason=(
            f"{failed.reason} [not recovered from the traces at "
            f"{'; '.join(fmt_sizes(s) for s in samples)}: {why}]")), tuple(samples))

    traces = []
    for sizes in samples:
        try:
            with concrete_trace(max(v.max for v in variables)):
                traces.append(concrete_jaxpr(fn, convention, sizes, counter))
        except Exception as e:  # noqa: BLE001 - it fails at a concrete size: the failure stands
            return refused(f"at {fmt_sizes(sizes)}, {describe_frame(user_frame(e))}: "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    jaxprs = [j for j, _ in traces]
    out_tree, out_paths = traces[0][1]
    if any(tuple(cell) != (out_tree, out_paths) for _, cell in traces[1:]):
        return refused("the output's structure differs between sizes")
    dims = symbolic_dims(variables)
    avals = convention.avals(dims)
    try:
        program = _program(jaxprs, samples)
    except Unrecoverable as e:
        return refused(str(e))

    def run(*flat):
        return tuple(_evaluate(program, flat, dims, samples))

    run.__name__ = getattr(fn, "__name__", "fn")
    names = [v.name for v in variables]
    cell = [out_tree, out_paths]
    try:
        traced = trace_program(run, avals, names, cell)
    except Unrecoverable as e:
        return refused(str(e))
    except Exception as e:  # noqa: BLE001 - a rebuild JAX refuses is no program
        return refused(f"rebuilding it over symbolic sizes failed ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    if isinstance(traced, Failed):
        return refused(f"rebuilding it over symbolic sizes failed: {traced.reason}")
    for sizes, concrete in zip(samples, jaxprs):
        got, want = _outputs(traced.jaxpr, sizes), _outputs(concrete)
        if got != want:
            return refused(f"the rebuilt program's outputs are {got} at {fmt_sizes(sizes)}, "
                           f"the trace's {want}")
    # Below the least size traced nothing was seen: a library's branch on a short length
    # (jnp.convolve swaps its operands below the kernel's size) would go unnoticed. So the
    # sizes down to the declared min are traced too, each kept while the same program
    # explains it (`_verified_below`). Ragged rows shorter than the last one kept are refused
    # at the call (`RowFloor`; rows below a declared min are otherwise run), and so are
    # unragged sizes (`below_traced`).
    samples = [*samples, *_verified_below(fn, convention, counter, lengths, samples, traces,
                                          traced)]
    lows = {v.name: min(s[v.name] for s in samples) for v in variables}
    line = failed.reason.split(": ")[0] if failed.reason else ""
    floors = tuple(RowFloor(n, lows[n], line, why=_never_traced(n, samples, lows[n]))
                   for n in convention.rows_at)
    return Recovery(dataclasses.replace(traced, floors=(*traced.floors, *floors),
                                        recovered=tuple(samples)), tuple(samples))


def _verified_below(fn, convention, counter, lengths, samples, traces, traced) -> list:
    """The sizes of the one length variable below `LOWEST`, down to its declared min, at
    which the recovered program is the one traced: from the largest down, each is traced and
    kept while the traces with it still fit one program (every integer explained, every
    constant a prefix) whose outputs have the trace's shapes; the first that does not (a
    branch, or JAX writing a unit axis differently) ends the descent."""
    if len(lengths) != 1:
        return []
    (name,) = lengths
    declared = next(v.min for v in convention.variables if v.name == name)
    least = min(samples, key=lambda s: s[name])
    kept, jaxprs = [], [j for j, _ in traces]
    for size in range(least[name] - 1, declared - 1, -1):
        sizes = {**least, name: size}
        try:
            with concrete_trace(max(v.max for v in convention.variables)):
                jaxpr, cell = concrete_jaxpr(fn, convention, sizes, counter)
            if tuple(cell) != tuple(traces[0][1]):
                break
            _program([*jaxprs, jaxpr], [*samples, *kept, sizes])
        except Exception:  # noqa: BLE001 - it fails or differs there: the floor stays above
            break
        if _outputs(traced.jaxpr, sizes) != _outputs(jaxpr):
            break
        kept.append(sizes)
        jaxprs.append(jaxpr)
    return kept


def _outputs(jaxpr, sizes: Mapping[str, int] | None = None) -> list:
    """``(shape, dtype)`` of each output of ``jaxpr``, a symbolic one's shapes at ``sizes``."""
    return [(evaluate_shape(a.shape, sizes) if sizes is not None else tuple(a.shape), a.dtype)
            for a in jaxpr.out_avals]


def _never_traced(name: str, samples: Sequence[Mapping[str, int]], low: int) -> str:
    return (f"cannot be traced over a symbolic {name}; its program was recovered from the "
            f"traces at {name} = {', '.join(str(s[name]) for s in samples)}, and below {low} "
            f"its program differs from that one or was never traced (a library may branch "
            f"there)")


def below_traced(convention: Convention, samples: Sequence[Mapping[str, int]],
                 where: str) -> tuple[RaisedMin, ...]:
    """The length variables whose declared min lies below the least size traced: an unragged
    size there is refused by name at the call, as below a raised min (`RaisedMin`). Not the
    rows of ragged lengths (``B``): a batch of one or two rows runs the recovered program."""
    rows = {by for _, by in convention.rows_at.values()}
    return tuple(RaisedMin(v.name, v.min, low, where, "", why=_never_traced(v.name, samples, low))
                 for v in convention.variables if v.name not in rows
                 for low in [min(s[v.name] for s in samples)] if low > v.min)
