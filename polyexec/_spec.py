"""Length variables, specs and their translation to `jax.export` symbolic shapes."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from ._errors import OptionError, SpecError, is_int

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Sizes reach the compiled programs as int32 (the real lengths passed next to the inputs, the
# `lengths_of` arrays, `dim_as_value`): a bound above this would overflow at trace time.
INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class LengthVar:
    """A named dynamic dimension, e.g. the sequence length ``T``.

    ``min``/``max`` become symbolic constraints of the one trace (``T >= 2`` is what lets
    ``x[:, :-1]`` trace), and bound every size the executor accepts. ``buckets`` is the default
    bucket policy for this variable: a `buckets` policy or a list of sizes (MIGraphX's
    "optimals"); without one, powers of two up to ``max`` are used.

    >>> import polyexec as px
    >>> T = px.LengthVar("T", min=2, max=1024)
    >>> T
    LengthVar('T', min=2, max=1024)
    """

    name: str
    min: int = 1
    max: int = dataclasses.field(default=None)  # type: ignore[assignment]
    buckets: Any = dataclasses.field(default=None, compare=False, hash=False)

    def __init__(self, name: str, *, min: int = 1, max: int, buckets: Any = None):
        if not isinstance(name, str) or not _NAME.match(name):
            raise SpecError(f"LengthVar: name: expected an identifier, received {name!r}")
        for label, value in (("min", min), ("max", max)):
            if not is_int(value):
                raise SpecError(f"LengthVar({name!r}): {label}: expected an int, received {value!r}")
        if min < 1:
            # jax.export symbolic dimensions are always >= 1; an empty sequence is a batch row
            # with length 0 in a lengths array, not a dimension of size 0.
            raise SpecError(f"LengthVar({name!r}): min: expected >= 1, received {min}")
        if max < min:
            raise SpecError(f"LengthVar({name!r}): max: expected >= min={min}, received {max}")
        if max > INT32_MAX:
            raise SpecError(f"LengthVar({name!r}): max: expected an int <= {INT32_MAX} (sizes run "
                            f"as int32), received {max}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "min", int(min))
        object.__setattr__(self, "max", int(max))
        object.__setattr__(self, "buckets", buckets)

    def __repr__(self) -> str:
        return f"LengthVar({self.name!r}, min={self.min}, max={self.max})"

    def constraints(self) -> list[str]:
        out = [f"{self.name} <= {self.max}"]
        if self.min > 1:
            out.append(f"{self.name} >= {self.min}")
        return out


Dim = Union[str, int, LengthVar]


@dataclasses.dataclass(frozen=True)
class Spec:
    """The shape of one length-polymorphic array: dims, optional dtype, and the pad value.

    ``dims`` is a string of variable names and integers (``"B T 64"``) or a sequence of
    `LengthVar`, names and ints. Inputs are padded with ``pad`` up to their bucket; outputs with
    a Spec are sliced back to the real sizes. ``lengths_of`` marks an array of per-example
    lengths along that variable: its values are checked to lie in ``[0, size]``.

    >>> import jax.numpy as jnp, polyexec as px
    >>> px.Spec("B T", jnp.int32, pad=0).dims
    ('B', 'T')
    """

    dims: tuple[str | int, ...]
    dtype: Any = None
    pad: Any = 0
    lengths_of: str | None = None
    # The LengthVar objects the Spec was given (in dims or lengths_of): they define their names
    # for every call that uses this Spec.
    variables: tuple[LengthVar, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __init__(self, dims: str | Sequence[Dim], dtype: Any = None, *, pad: Any = 0,
                 lengths_of: str | LengthVar | None = None):
        parsed = _parse_dims(dims)
        given = [d for d in ([] if isinstance(dims, str) else list(dims)) + [lengths_of]
                 if isinstance(d, LengthVar)]
        where = f"Spec({dims!r})"
        object.__setattr__(self, "dims", parsed)
        object.__setattr__(self, "dtype", None if dtype is None else _check_dtype(dtype, where))
        object.__setattr__(self, "pad", _check_pad(pad, where))
        if isinstance(lengths_of, LengthVar):
            lengths_of = lengths_of.name
        elif lengths_of is not None and not (isinstance(lengths_of, str) and _NAME.match(lengths_of)):
            raise SpecError(f"{where}: lengths_of: expected a LengthVar or a length-variable name, "
                            f"received {lengths_of!r}")
        object.__setattr__(self, "lengths_of", lengths_of)
        object.__setattr__(self, "variables", tuple(dict.fromkeys(given)))

    @property
    def var_names(self) -> tuple[str, ...]:
        return tuple(d for d in self.dims if isinstance(d, str))

    def __repr__(self) -> str:
        dt = "" if self.dtype is None else f", {self.dtype.name}"
        return f"Spec({' '.join(map(str, self.dims))!r}{dt}, pad={self.pad!r})"


def _check_dtype(dtype: Any, where: str) -> np.dtype:
    """``dtype`` as a NumPy dtype that JAX computes with: a number or bool (bfloat16 included).
    An object or string dtype would only fail later, inside tracing or XLA."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or not (jnp.issubdtype(dt, jnp.number) or dt == np.bool_):
        received = repr(dtype) if dt is None else f"{dtype!r} ({dt.name})"
        raise SpecError(f"{where}: dtype: expected a numeric or bool dtype such as jnp.float32, "
                        f"jnp.int32 or 'bfloat16', received {received}")
    return dt


def _check_pad(pad: Any, where: str) -> Any:
    """The pad value is written into every padded element: it must be one number or bool."""
    if not isinstance(pad, (str, bytes)):
        try:
            arr = np.asarray(pad)
        except Exception:  # noqa: BLE001 -- anything NumPy cannot read is refused below
            arr = None
        if arr is not None and arr.ndim == 0 and (arr.dtype == np.bool_
                                                  or jnp.issubdtype(arr.dtype, jnp.number)):
            return pad
    raise SpecError(f"{where}: pad: expected a number or bool (the value padding is filled "
                    f"with), received {type(pad).__name__} {pad!r}")


def _parse_dims(dims: str | Sequence[Dim]) -> tuple[str | int, ...]:
    if not isinstance(dims, (str, Sequence)) or isinstance(dims, bytes):
        raise SpecError(f"Spec: dims: expected a string of length-variable names and ints "
                        f"(\"B T 64\") or a sequence of LengthVars, names and ints, received "
                        f"{type(dims).__name__} {dims!r}")
    items = dims.replace(",", " ").split() if isinstance(dims, str) else list(dims)
    out: list[str | int] = []
    for item in items:
        if isinstance(item, LengthVar):
            out.append(item.name)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(int(item))
        elif isinstance(item, str) and item.isdigit():
            out.append(int(item))
        elif isinstance(item, str) and _NAME.match(item):
            out.append(item)
        else:
            raise SpecError(f"Spec dims {dims!r}: expected length-variable names, LengthVars or "
                            f"ints, received {item!r}")
    return tuple(out)


def spec_leaves(tree: Any) -> list[Spec]:
    return [s for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Spec))
            if isinstance(s, Spec)]


@dataclasses.dataclass(frozen=True)
class CallVariables:
    """The length variables of one bucketed function, resolved once when it is made.

    ``inputs`` are bound by input shapes (and ``lengths_of``); the rest of ``variables`` are
    data-dependent sizes that a partition point defines (named by out_specs or buckets)."""

    variables: Mapping[str, LengthVar]
    inputs: tuple[str, ...]
    policies: Mapping[str, Any]


def call_variables(in_specs: Any, out_specs: Any, buckets: Mapping[Any, Any] | None,
                   variables: Sequence[LengthVar], where: str) -> CallVariables:
    buckets = dict(buckets or {})
    # Checked whole first: iterating a LengthVar or None fails with a bare TypeError, and a
    # string would iterate into characters.
    if isinstance(variables, (str, bytes, LengthVar)) or not isinstance(variables, Iterable):
        received = (f"a single LengthVar {variables!r}" if isinstance(variables, LengthVar)
                    else f"{type(variables).__name__} {variables!r}")
        raise OptionError(f"{where}: variables: expected a sequence of px.LengthVar (e.g. "
                          f"variables=[T]), received {received}")
    variables = tuple(variables)
    for i, var in enumerate(variables):
        if not isinstance(var, LengthVar):
            raise OptionError(f"{where}: variables[{i}]: expected a px.LengthVar, received "
                              f"{type(var).__name__} {var!r}")
    in_leaves, out_leaves = spec_leaves(in_specs), spec_leaves(out_specs)
    given = ([v for s in in_leaves + out_leaves for v in s.variables] + list(variables)
             + [k for k in buckets if isinstance(k, LengthVar)])
    inputs = list(dict.fromkeys([n for s in in_leaves for n in s.var_names]
                                + [s.lengths_of for s in in_leaves if s.lengths_of]))
    names = list(dict.fromkeys(inputs + [n for s in out_leaves for n in s.var_names]
                               + [v.name for v in given]))
    resolved = resolve_vars(names, given, where)
    policies = {}
    for key, policy in buckets.items():
        name = key.name if isinstance(key, LengthVar) else key
        if name not in resolved:
            raise SpecError(f"{where}: buckets: expected keys among the variables the Specs use "
                              f"({', '.join(resolved) or 'none'}), received {name!r}")
        policies[name] = policy
    return CallVariables(resolved, tuple(inputs), policies)


def resolve_vars(names: Sequence[str], given: Sequence[LengthVar], where: str) -> dict[str, LengthVar]:
    """What each Spec name means for one call, decided locally.

    A name resolves to the LengthVar of that name among ``given`` (the LengthVars the call was
    handed: inside its Specs, as ``buckets`` keys, in ``variables=``), else among the LengthVars
    visible where the call was made (the caller's local, then global names). Nothing is
    process-wide: a later ``LengthVar("T")`` changes nothing about a function that exists.
    """
    named: dict[str, LengthVar] = {}
    for var in given:
        other = named.setdefault(var.name, var)
        if other != var:
            raise SpecError(f"{where}: two different LengthVars are named {var.name!r}: {other} and "
                            f"{var}; give one of them another name")
    missing = [n for n in names if n not in named]
    if missing:
        scopes = _visible_length_vars()
        for name in missing:
            # Local names shadow global ones.
            found = next((scope[name] for scope in scopes if name in scope), [])
            if len(found) > 1:
                raise SpecError(f"{where}: Spec name {name!r} is ambiguous here ({found[0]} and "
                                f"{found[1]} are both in scope); pass the LengthVar itself, "
                                f"e.g. px.Spec(({name}, ...)) or variables=[{name}]")
            if not found:
                raise SpecError(
                    f"{where}: Spec name {name!r}: expected a LengthVar named {name!r} given to "
                    f"this call (in a Spec, a buckets key or variables=) or defined where it is "
                    f"made, e.g. {name} = px.LengthVar({name!r}, max=...); received none "
                    f"(known: {', '.join(sorted(named)) or 'none'})")
            named[name] = found[0]
    return {n: named[n] for n in dict.fromkeys(list(names))}


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that points at the first frame outside
    polyexec (the user's ``bucketed(...)`` line, not the executor's)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _visible_length_vars() -> list[dict[str, list[LengthVar]]]:
    """The LengthVars bound to names in the first frame outside polyexec: its locals, then its
    globals, each as {LengthVar name: the distinct LengthVars of that name}."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return []
    scopes = []
    for names in (frame.f_locals, frame.f_globals):
        found: dict[str, list[LengthVar]] = {}
        for value in list(names.values()):
            if isinstance(value, LengthVar) and value not in found.get(value.name, []):
                found.setdefault(value.name, []).append(value)
        scopes.append(found)
    return scopes


def symbolic_dims(variables: Sequence[LengthVar]) -> dict[str, Any]:
    """One `jax.export` symbolic scope holding every variable with its bounds as constraints."""
    if not variables:
        return {}
    constraints = [c for v in variables for c in v.constraints()]
    dims = export.symbolic_shape(", ".join(v.name for v in variables), constraints=constraints)
    return {v.name: d for v, d in zip(variables, dims)}


def default_bucket_sizes(var: LengthVar) -> tuple[int, ...]:
    """Powers of two from ``min`` up to ``max`` (``max`` itself always included)."""
    sizes = []
    size = 1
    while size < var.max:
        if size >= var.min:
            sizes.append(size)
        size *= 2
    return tuple(sizes) + (var.max,)


def bucket_sizes(var: LengthVar, policy: Any = None) -> tuple[int, ...]:
    """The sorted sizes a variable is compiled at: the policy's sizes within bounds, plus max.

    Sizes must be ints >= 1 and at least one must be given (else `SpecError`). Sizes outside
    ``[min, max]`` are legal but useless -- below ``min`` no input is that short, above ``max``
    none is that long -- so they are not compiled, with one warning naming them: a policy
    fitted to other data, or a LengthVar whose bounds changed, is worth hearing about, while
    refusing would break code whose policy is shared between variables of different bounds.
    """
    policy = var.buckets if policy is None else policy
    if policy is None:
        return default_bucket_sizes(var)
    where = f"buckets for {var.name!r}"
    raw = getattr(policy, "sizes", policy)
    try:
        # Only ints: a string would iterate into digits, a float be truncated without a word.
        if isinstance(raw, (str, bytes)) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in raw):
            raise TypeError
        sizes = sorted({int(s) for s in raw})
    except TypeError:
        raise SpecError(
            f"{where}: expected a bucket policy (with .sizes) or a list of "
            f"ints, received {policy!r}") from None
    if not sizes:
        raise SpecError(f"{where}: expected at least one bucket size (or None for the default "
                        f"powers of two), received {policy!r}")
    bad = [s for s in sizes if s < 1]
    if bad:
        raise SpecError(f"{where}: expected sizes >= 1, received {', '.join(map(str, bad))} "
                        f"in {policy!r}")
    below = [s for s in sizes if s < var.min]
    above = [s for s in sizes if s > var.max]
    if below or above:
        parts = ([f"{', '.join(map(str, below))} below min={var.min}"] if below else []) + (
            [f"{', '.join(map(str, above))} above max={var.max}"] if above else [])
        warnings.warn(f"{where}: sizes {' and '.join(parts)} of {var} are not compiled: no input "
                      f"can have them (drop them, or change the LengthVar's bounds)",
                      stacklevel=_user_stacklevel())
    # max itself is always a bucket: every size the LengthVar accepts must have one.
    sizes = [s for s in sizes if var.min <= s < var.max]
    return tuple(sizes) + (var.max,)
