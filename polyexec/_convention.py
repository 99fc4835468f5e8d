"""Stage 2b, convention: the one order of a program's flat inputs.

Every program polyexec traces, exports and compiles takes flat arrays. Which array sits at
which position -- the non-Spec arrays, the Spec'd (padded) arrays, the values an earlier
segment handed across a cut, then the real size of each length variable -- is decided here,
once per signature, as a frozen `Convention`. Tracing asks it for the avals and for the parts
of a flat argument list; the logical rewrite asks where the real sizes are; the executor asks
it to assemble a call and where shardings and donation apply. No other module computes an
index into the flat inputs: a new physical layout (per-row lengths, packed rows) is a new kind
of slot here.

>>> import jax.numpy as jnp, numpy as np, polyexec as px
>>> from polyexec._bind import bind
>>> T = px.LengthVar("T", max=64)
>>> call = bind((np.ones(3, np.float32), np.zeros((5, 2), np.float32)),
...             (None, px.Spec("T 2", jnp.float32)), {"T": T})
>>> convention = Convention.of(call.signature, [T])
>>> convention.paths
('args[0]', 'args[1]', 'valid_length(T)')
>>> [a.shape for a in convention.avals({"T": 8})]
[(3,), (8, 2), ()]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax import export

from ._bind import Signature
from ._jax_internals import evaluate_dim
from ._spec import LengthVar, Spec

SlotKind = Literal["array", "poly", "handed", "size"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One flat input: what it is, where it comes from, and its shape.

    ``dims`` per axis: an int, a length variable's name, or (a value handed across a cut) a
    symbolic dimension of the segment that made it. ``arg`` is the positional argument an
    array or Spec'd array comes from (shardings and donation are per argument)."""

    kind: SlotKind
    path: str
    dims: tuple[Any, ...]
    dtype: np.dtype
    arg: int | None = None
    spec: Spec | None = None       # "poly" slots
    name: str | None = None        # "size" slots: the variable


@dataclasses.dataclass(frozen=True)
class Parts:
    """A flat argument list taken apart by its convention."""

    arrays: list[Any]
    poly: list[Any]
    handed: list[Any]
    sizes: dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Convention:
    """The flat inputs of one program, in order: arrays, Spec'd arrays, handed values, sizes."""

    slots: tuple[Slot, ...]
    variables: tuple[LengthVar, ...]     # whose real sizes the program takes, in slot order
    signature: Signature | None = None   # None for a plan loaded from a file (never traced)

    @staticmethod
    def of(signature: Signature, variables: Sequence[LengthVar],
           handed: Sequence[tuple[str, tuple[Any, ...], np.dtype]] = ()) -> "Convention":
        """The convention of a call signature; ``handed`` lists (path, dims, dtype) of values
        an earlier segment hands over (the cut axis named by its variable)."""
        slots = [Slot("array", path, tuple(shape), np.dtype(dtype), arg)
                 for path, (shape, dtype), arg in zip(signature.leaf_paths("array"),
                                                      signature.array_avals,
                                                      signature.leaf_args("array"))]
        slots += [Slot("poly", path, spec.dims, np.dtype(dtype), arg, spec=spec)
                  for path, (spec, dtype), arg in zip(signature.leaf_paths("poly"),
                                                      signature.poly,
                                                      signature.leaf_args("poly"))]
        slots += [Slot("handed", path, tuple(dims), np.dtype(dtype))
                  for path, dims, dtype in handed]
        return Convention(tuple(slots) + _size_slots(variables), tuple(variables), signature)

    @staticmethod
    def stored(input_specs: Sequence[Any], input_paths: Sequence[str],
               variables: Sequence[LengthVar]) -> "Convention":
        """The convention of a plan file: its inputs, each a Spec or a fixed (shape, dtype),
        called as positional arguments in that order."""
        slots = []
        for arg, (spec, path) in enumerate(zip(input_specs, input_paths)):
            if isinstance(spec, Spec):
                slots.append(Slot("poly", path, spec.dims, np.dtype(spec.dtype), arg, spec=spec))
            else:
                slots.append(Slot("array", path, tuple(spec[0]), np.dtype(spec[1]), arg))
        return Convention(tuple(slots) + _size_slots(variables), tuple(variables))

    # -- what the stages ask --------------------------------------------------------------------

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.slots)

    @functools.cached_property
    def sizes_at(self) -> dict[str, int]:
        """Each variable's name -> the position of its real size (what the rewrite reads)."""
        return {s.name: i for i, s in enumerate(self.slots) if s.kind == "size"}

    @functools.cached_property
    def rows_at(self) -> dict[str, tuple[int, str]]:
        """Each variable ragged along rows -> (position of its lengths, the rows variable):
        a ``lengths_of="T"`` input of dims ``"B"`` makes ``T`` ragged along ``B``."""
        names = {v.name for v in self.variables}
        out: dict[str, tuple[int, str]] = {}
        for i, s in enumerate(self.slots):
            spec = s.spec
            if (s.kind == "poly" and spec.lengths_of in names and len(spec.dims) == 1
                    and spec.dims[0] in names and spec.dims[0] != spec.lengths_of):
                out.setdefault(spec.lengths_of, (i, spec.dims[0]))
        return out

    @functools.cached_property
    def input_specs(self) -> tuple[Any, ...]:
        """Per array and Spec'd input: its Spec, or its fixed (shape, dtype) (a plan file's)."""
        return tuple(s.spec if s.kind == "poly" else (s.dims, s.dtype)
                     for s in self.slots if s.kind in ("array", "poly"))

    def count(self, kind: SlotKind) -> int:
        return sum(s.kind == kind for s in self.slots)

    def avals(self, sizes: Mapping[str, Any]) -> list[jax.ShapeDtypeStruct]:
        """The inputs' avals with each variable at ``sizes`` (ints, or symbolic dims of one
        scope: then the avals are the symbolic program's)."""
        scope = next((d.scope for d in sizes.values() if export.is_symbolic_dim(d)), None)
        concrete = {n: v for n, v in sizes.items() if not export.is_symbolic_dim(v)}

        def dim(d):
            if isinstance(d, str):
                return sizes[d]
            if not export.is_symbolic_dim(d):
                return int(d)
            if scope is not None:   # an earlier segment's dimension, read into this scope
                return export.symbolic_shape(str(d), scope=scope)[0]
            return int(evaluate_dim(d, concrete))

        return [jax.ShapeDtypeStruct(tuple(dim(d) for d in s.dims), s.dtype) for s in self.slots]

    def split(self, flat: Sequence[Any]) -> Parts:
        parts = Parts([], [], [], {})
        for slot, value in zip(self.slots, flat, strict=True):
            if slot.kind == "size":
                parts.sizes[slot.name] = value
            else:
                getattr(parts, "arrays" if slot.kind == "array" else slot.kind).append(value)
        return parts

    def assemble(self, *, arrays: Sequence[Any], poly: Sequence[Any], sizes: Mapping[str, int],
                 handed: Sequence[Any] = ()) -> list[Any]:
        """A call's flat arguments in slot order (real sizes as int32 scalars)."""
        sources = {"array": iter(arrays), "poly": iter(poly), "handed": iter(handed)}
        return [np.int32(sizes[s.name]) if s.kind == "size" else next(sources[s.kind])
                for s in self.slots]

    def with_shardings(self, avals: Sequence[Any], shardings: Sequence[Any] | None) -> list[Any]:
        """``avals`` carrying each argument's sharding (arrays and Spec'd arrays)."""
        if shardings is None:
            return list(avals)
        return [aval if s.arg is None or s.arg >= len(shardings) or shardings[s.arg] is None
                else jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=shardings[s.arg])
                for s, aval in zip(self.slots, avals)]

    def donated(self, argnums: Sequence[int]) -> tuple[int, ...]:
        """Positions of the non-Spec arrays of the donated arguments (Spec'd inputs are padded
        host copies, never the caller's buffers), typed PRNG keys excepted.

        A key enters the program as its uint32 data and leaves it as a key (``key<fry>[]``):
        XLA aliases a donated input only to an output of the same shape and dtype, so a key's
        data never finds one, and donating it made JAX warn "Some donated buffers were not
        usable: uint32[2]" on every compile of a train step whose model holds a key (an NNX
        ``nnx.Dropout`` or ``nnx.RNN``). It is a few bytes: kept, not donated."""
        keys = iter(self.signature.array_keys if self.signature is not None else ())
        return tuple(i for i, s in enumerate(self.slots)
                     if s.kind == "array" and next(keys, None) is None and s.arg in argnums)


def _size_slots(variables: Sequence[LengthVar]) -> tuple[Slot, ...]:
    return tuple(Slot("size", f"valid_length({v.name})", (), np.dtype(np.int32), name=v.name)
                 for v in variables)
