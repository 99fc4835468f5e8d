"""Length variables, specs and their translation to `jax.export` symbolic shapes."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
from jax import export

from ._errors import SpecError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
            raise SpecError(f"LengthVar name must be an identifier, got {name!r}")
        for label, value in (("min", min), ("max", max)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise SpecError(f"LengthVar({name!r}): {label} must be an int, got {value!r}")
        if min < 1:
            # jax.export symbolic dimensions are always >= 1; an empty sequence is a batch row
            # with length 0 in a lengths array, not a dimension of size 0.
            raise SpecError(f"LengthVar({name!r}): min must be >= 1, got {min}")
        if max < min:
            raise SpecError(f"LengthVar({name!r}): max={max} is below min={min}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "min", int(min))
        object.__setattr__(self, "max", int(max))
        object.__setattr__(self, "buckets", buckets)
        _register(self)

    def __repr__(self) -> str:
        return f"LengthVar({self.name!r}, min={self.min}, max={self.max})"

    @classmethod
    def _unregistered(cls, name: str, min: int, max: int) -> "LengthVar":
        """A variable that string Specs do not resolve to (for plans loaded from disk)."""
        var = object.__new__(cls)
        for field, value in (("name", name), ("min", int(min)), ("max", int(max)), ("buckets", None)):
            object.__setattr__(var, field, value)
        return var

    def constraints(self) -> list[str]:
        out = [f"{self.name} <= {self.max}"]
        if self.min > 1:
            out.append(f"{self.name} >= {self.min}")
        return out


# Specs name their variables by string ("B T 64"); the most recent LengthVar of each name is the
# one a string refers to (re-running a notebook cell redefines it). A bucketed function resolves
# names once, when it is created.
_REGISTRY: dict[str, LengthVar] = {}
_REGISTRY_LOCK = threading.Lock()


def _register(var: LengthVar) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY[var.name] = var


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

    def __init__(self, dims: str | Sequence[Dim], dtype: Any = None, *, pad: Any = 0,
                 lengths_of: str | LengthVar | None = None):
        parsed = _parse_dims(dims)
        object.__setattr__(self, "dims", parsed)
        object.__setattr__(self, "dtype", None if dtype is None else np.dtype(dtype))
        object.__setattr__(self, "pad", pad)
        if isinstance(lengths_of, LengthVar):
            lengths_of = lengths_of.name
        object.__setattr__(self, "lengths_of", lengths_of)

    @property
    def var_names(self) -> tuple[str, ...]:
        return tuple(d for d in self.dims if isinstance(d, str))

    def __repr__(self) -> str:
        dt = "" if self.dtype is None else f", {self.dtype.name}"
        return f"Spec({' '.join(map(str, self.dims))!r}{dt}, pad={self.pad!r})"


def _parse_dims(dims: str | Sequence[Dim]) -> tuple[str | int, ...]:
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
            raise SpecError(f"Spec dims {dims!r}: {item!r} is neither a length-variable name nor an int")
    return tuple(out)


def resolve_vars(names: Sequence[str], explicit: Mapping[str, LengthVar]) -> dict[str, LengthVar]:
    """Look the names up in ``explicit`` first, then among defined LengthVars."""
    out = {}
    for name in names:
        var = explicit.get(name) or _REGISTRY.get(name)
        if var is None:
            known = sorted(set(explicit) | set(_REGISTRY))
            raise SpecError(
                f"Spec names unknown length variable {name!r}; define it with "
                f"px.LengthVar({name!r}, max=...). Known: {', '.join(known) or 'none'}")
        out[name] = var
    return out


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
    """The sorted sizes a variable is compiled at: the policy's sizes within bounds, plus max."""
    policy = var.buckets if policy is None else policy
    if policy is None:
        return default_bucket_sizes(var)
    raw = getattr(policy, "sizes", policy)
    try:
        # Only ints: a string would iterate into digits, a float be truncated without a word.
        if isinstance(raw, (str, bytes)) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in raw):
            raise TypeError
        sizes = sorted({int(s) for s in raw})
    except TypeError:
        raise SpecError(
            f"buckets for {var.name!r} must be a bucket policy (with .sizes) or a list of ints, "
            f"got {policy!r}") from None
    # A bucket below min is never used; above max it would compile for sizes no input can have.
    sizes = [s for s in sizes if var.min <= s < var.max]
    return tuple(sizes) + (var.max,)
