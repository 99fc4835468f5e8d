"""The boundary between user arguments and the flat program: validate, bind lengths, pad, slice.

Every check here runs before anything is traced or compiled, so bad input never costs a compile
and never reaches XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ._errors import LengthOverflowError, OptionError, SpecError, is_int
from ._spec import LengthVar, Spec


class _Fixed:
    """Marks leaves of an argument whose spec is None: arrays at their own shape, rest static."""

    def __repr__(self) -> str:
        return "None"


FIXED = _Fixed()


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, Spec)


def spec_per_leaf(specs: Any, tree: Any, what: str) -> list[Spec | _Fixed]:
    """Broadcast a prefix tree of Specs/None (like `jax.jit`'s in_axes) to the leaves of ``tree``."""

    def expand(spec, subtree):
        structure = jax.tree_util.tree_structure(subtree)
        fill = FIXED if spec is None else spec
        return jax.tree_util.tree_unflatten(structure, [fill] * structure.num_leaves)

    try:
        full = jax.tree_util.tree_map(expand, specs, tree, is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as e:
        raise SpecError(f"{what} does not match the structure of the values: {e}") from None
    return jax.tree_util.tree_structure(tree).flatten_up_to(full)


def canonical_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


@dataclasses.dataclass(frozen=True)
class Signature:
    """Everything a traced program depends on besides the lengths: one plan per signature."""

    treedef: Any
    kinds: tuple[str, ...]                       # per leaf: "poly", "array" or "static"
    statics: tuple[Any, ...]                     # the static leaves, in order
    array_avals: tuple[tuple[tuple[int, ...], np.dtype], ...]
    # Per "array" leaf: the impl of a typed PRNG key, which travels as its uint32 key data (the
    # aval above) and is rewrapped where the function is called; None for any other array.
    array_keys: tuple[Any, ...]
    poly: tuple[tuple[Spec, np.dtype], ...]
    paths: tuple[str, ...] = dataclasses.field(compare=False)
    args: tuple[int, ...] = dataclasses.field(compare=False, default=())  # per leaf: argument

    @property
    def rows_variables(self) -> frozenset[str]:
        """The variables a ``lengths_of`` input is indexed by (the rows, ``B``)."""
        return frozenset(d for spec, _ in self.poly if spec.lengths_of
                         for d in spec.dims if isinstance(d, str))

    def leaf_paths(self, kind: str) -> list[str]:
        return [p for p, k in zip(self.paths, self.kinds) if k == kind]

    def leaf_args(self, kind: str) -> list[int]:
        return [a for a, k in zip(self.args, self.kinds) if k == kind]

    def unflatten(self, arrays: Sequence[Any], poly: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments from their array and Spec'd leaves (statics restored, typed
        PRNG keys rewrapped from their data)."""
        arrays = [a if impl is None else jax.random.wrap_key_data(a, impl=impl)
                  for a, impl in zip(arrays, self.array_keys, strict=True)]
        sources = {"array": iter(arrays), "poly": iter(poly), "static": iter(self.statics)}
        return jax.tree_util.tree_unflatten(self.treedef,
                                            [next(sources[kind]) for kind in self.kinds])


@dataclasses.dataclass
class BoundCall:
    signature: Signature
    arrays: list[Any]                # the "array" leaves as given (a typed key: its data)
    poly: list[Any]                  # the "poly" leaves, as arrays of the canonical dtype
    sizes: dict[str, int]            # each length variable's real size


def _path(keypath, offset: int = 0) -> str:
    if offset:   # arguments the caller did not pass (a loaded plan's stored constants)
        first, rest = keypath[0], keypath[1:]
        return f"args[{first.idx - offset}]" + jax.tree_util.keystr(tuple(rest))
    return "args" + jax.tree_util.keystr(keypath)


def _check_spec_args(args: Sequence[Any], in_specs: Sequence[Any], offset: int) -> None:
    """A Spec that meets no array (``f(None)``, an empty tuple) would bind nothing: its
    variables would go unbound and the call fail deep inside. Refuse it by its path."""
    def check(keypath, spec, value):
        if isinstance(spec, Spec) and not jax.tree_util.tree_leaves(value):
            raise SpecError(f"{_path(keypath, offset)}: expected an array for {spec}, received "
                            f"{type(value).__name__} {value!r}")

    try:
        jax.tree_util.tree_map_with_path(check, tuple(in_specs), tuple(args), is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as e:
        if isinstance(e, SpecError):
            raise
        # A structure mismatch: spec_per_leaf reports it with the whole structure.


def _check_concrete(args: Sequence[Any], offset: int) -> None:
    """Refuse a JAX tracer anywhere in the arguments, before anything reads a size or a value:
    under ``jax.jit``/``grad``/``vmap`` polyexec would fail deep inside, reading a tracer's
    values on the host or handing it to a compiled executable (a raw ConcretizationTypeError
    or 'Cannot apply JAX transformations to a function lowered and compiled')."""
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(tuple(args)):
        if isinstance(leaf, jax.core.Tracer):
            raise SpecError(
                f"{_path(keypath, offset)}: expected a concrete array, received a JAX tracer "
                f"({leaf.aval.str_short()}): the bucketed function was called inside jax.jit, "
                f"jax.grad, jax.vmap or another transformation. It reads sizes on the host and "
                f"runs its own program compiled per bucket, which takes no tracers: call it "
                f"outside the transformation, or transform the function it wraps instead "
                f"(px.bucketed(jax.grad(loss), ...))")


def _lists_as_arrays(args: Sequence[Any], specs: Sequence[Any]) -> tuple[Any, ...]:
    """A (nested) Python list given where a Spec expects an array is one array, not a pytree
    of scalars: read it as NumPy would, so errors speak of its rank, not of ``args[0][0][0]``."""
    out = []
    for i, (arg, spec) in enumerate(zip(args, specs)):
        if isinstance(spec, Spec) and isinstance(arg, (list, tuple)):
            arg = _as_array(arg, f"args[{i}]")
        out.append(arg)
    return tuple(out)


def is_key(leaf: Any) -> bool:
    """A typed PRNG key array (``jax.random.key(0)``, dtype ``key<fry>``)."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _as_array(leaf: Any, path: str) -> Any:
    if is_key(leaf):
        raise SpecError(f"{path}: expected an array of numbers or bools, received a typed PRNG "
                        f"key array (dtype {leaf.dtype}, shape {tuple(leaf.shape)}): a key has "
                        f"no length axis to pad (give it None in in_specs: it is then passed "
                        f"through as it is)")
    if isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
    try:
        arr = np.asarray(leaf)
    except Exception as e:  # ragged lists and the like
        raise SpecError(f"{path}: expected an array, received {type(leaf).__name__} ({e})") from None
    if arr.dtype == object:
        raise SpecError(f"{path}: expected an array, received {type(leaf).__name__} "
                        f"that NumPy can only hold as dtype=object")
    if arr.dtype.kind not in "biufc":
        # Strings, datetimes, raw bytes: JAX cannot compute with them.
        raise SpecError(f"{path}: expected an array of numbers or bools, received "
                        f"{type(leaf).__name__} of dtype {arr.dtype}")
    return arr


def _dtype_kind(dtype: np.dtype) -> str:
    return {"u": "integer", "i": "integer", "f": "floating", "c": "complex", "b": "bool"}.get(
        dtype.kind, dtype.name)


def bind(args: Sequence[Any], in_specs: Sequence[Any], variables: Mapping[str, LengthVar],
         offset: int = 0) -> BoundCall:
    """Validate ``args`` against ``in_specs`` and read every length variable's size. The first
    ``offset`` arguments are not the caller's (errors count positions after them)."""
    _check_concrete(args, offset)
    if len(args) != len(in_specs):
        raise SpecError(f"expected {len(in_specs) - offset} positional arguments (one per "
                        f"in_specs entry), received {len(args) - offset}")
    _check_spec_args(args, in_specs, offset)
    args = _lists_as_arrays(args, in_specs)
    specs = spec_per_leaf(tuple(in_specs), args, "in_specs")
    keyed, treedef = jax.tree_util.tree_flatten_with_path(args)
    kinds, statics, arrays, array_avals, poly, poly_sig, paths, args = [], [], [], [], [], [], [], []
    array_keys = []
    given = []       # the Spec'd leaves as received, before any cast: values are checked on these
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}

    for (keypath, leaf), spec in zip(keyed, specs):
        path = _path(keypath, offset)
        paths.append(path)
        args.append(keypath[0].idx)
        if spec is FIXED:
            if isinstance(leaf, (jax.Array, np.ndarray)):
                impl = None
                if is_key(leaf):
                    # Its data stands in for it from here to the traced call (`unflatten`):
                    # signatures, conventions, jax.export and plan files see plain uint32.
                    impl, leaf = jax.random.key_impl(leaf), jax.random.key_data(leaf)
                kinds.append("array")
                arrays.append(leaf)
                array_avals.append((tuple(leaf.shape), canonical_dtype(leaf.dtype)))
                array_keys.append(impl)
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise SpecError(f"{path}: a non-array leaf of an argument without a Spec is "
                                    f"static and must be hashable; received an unhashable "
                                    f"{type(leaf).__name__}") from None
                kinds.append("static")
                statics.append(leaf)
            continue

        arr = _as_array(leaf, path)
        if arr.ndim != len(spec.dims):
            raise SpecError(f"{path}: expected rank {len(spec.dims)} for {spec}, received rank "
                            f"{arr.ndim} (shape {tuple(arr.shape)})")
        received = np.dtype(arr.dtype)
        if spec.dtype is not None and _dtype_kind(received) != _dtype_kind(spec.dtype):
            raise SpecError(f"{path}.dtype: expected {spec.dtype.name} for {spec}, received "
                            f"{received.name}")
        target = canonical_dtype(spec.dtype if spec.dtype is not None else received)
        for axis, (dim, size) in enumerate(zip(spec.dims, arr.shape)):
            here = f"{path}.shape[{axis}]"
            if isinstance(dim, int):
                if size != dim:
                    raise SpecError(f"{here}: expected {dim} for {spec}, received {size}")
                continue
            var = variables[dim]
            if dim in sizes:
                if sizes[dim] != size:
                    raise SpecError(f"{here} = {size} disagrees with {where[dim]} = {sizes[dim]}: "
                                    f"both are length variable {dim!r}")
                continue
            if size > var.max:
                raise LengthOverflowError(f"{here} = {size} is above {dim}'s max={var.max} ({var})")
            if size < var.min:
                raise SpecError(f"{here} = {size} is below {dim}'s min={var.min} ({var})")
            sizes[dim] = size
            where[dim] = here
        if spec.lengths_of is None and received != target:
            _check_fits(arr, target, path)
        kinds.append("poly")
        given.append(arr)
        poly.append(arr if received == target else np.asarray(arr, target))
        poly_sig.append((spec, target))

    _check_lengths(keyed, specs, given, sizes, where, variables, offset)
    signature = Signature(treedef, tuple(kinds), tuple(statics), tuple(array_avals),
                          tuple(array_keys), tuple(poly_sig), tuple(paths), tuple(args))
    return BoundCall(signature, arrays, poly, sizes)


def _check_fits(arr: Any, target: np.dtype, path: str) -> None:
    """An integer input narrowed to the dtype it runs at (int64 -> int32 without x64) must fit
    it: NumPy's cast wraps around without a word (2**32 + 3 becomes 3)."""
    received = np.dtype(arr.dtype)
    if received.kind not in "iu" or target.kind not in "iu" or arr.size == 0:
        return
    info = np.iinfo(target)
    if np.iinfo(received).min >= info.min and np.iinfo(received).max <= info.max:
        return
    values = np.asarray(arr)   # in the received dtype: the comparison itself must not wrap
    bad = np.argwhere((values < info.min) | (values > info.max))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise SpecError(f"{path}{list(idx)} = {values[idx]}: expected values that fit "
                        f"{target.name} (the dtype it runs at, in [{info.min}, {info.max}]), "
                        f"received {values[idx]} ({received.name})")


def _check_lengths(keyed, specs, given, sizes, where, variables, offset) -> None:
    """Arrays marked ``lengths_of=T`` must hold integers in ``[0, T]``.

    Checked on the values as given, before they are cast to the dtype they run at (int32):
    a cast first would wrap ``2**32 + 3`` to 3 and read a uint32 ``2**32 - 1`` as -1."""
    poly_iter = iter(given)
    for (keypath, _), spec in zip(keyed, specs):
        if spec is FIXED:
            continue
        arr = next(poly_iter)
        if spec.lengths_of is None:
            continue
        name = spec.lengths_of
        if name not in variables:
            raise SpecError(f"{_path(keypath, offset)}: lengths_of={name!r} names no length variable of "
                            f"this function (known: {', '.join(variables)})")
        if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
            # A global array across processes: no process can read it whole. Each process's
            # share was checked where it was made (polyexec.training checks its batches).
            continue
        values = np.asarray(arr)
        if values.dtype.kind not in "iu":
            raise SpecError(f"{_path(keypath, offset)}.dtype: expected an integer dtype for the "
                            f"lengths of {name!r} ({spec}), received {values.dtype.name}")
        bad = np.argwhere(values < 0)
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            raise SpecError(f"{_path(keypath, offset)}{list(idx)} = {values[idx]}: lengths of {name!r} "
                            f"must be >= 0")
        limit = sizes.get(name, variables[name].max)
        bad = np.argwhere(values > limit)
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            source = where.get(name, f"{name}'s max")
            raise SpecError(f"{_path(keypath, offset)}{list(idx)} = {values[idx]}: lengths of {name!r} "
                            f"must be <= {source} = {limit}")


def check_row_floors(call: BoundCall, floors: Mapping[str, Any]) -> None:
    """Refuse a ragged row shorter than the plan reads right (``floors``: per variable, a
    `_logical.RowFloor`), before anything runs: ``x[:, :k]`` of a shorter row would read past
    its end, where plain JAX on that row alone gives fewer positions."""
    if not floors:
        return
    for (spec, _), path, arr in zip(call.signature.poly, call.signature.leaf_paths("poly"),
                                    call.poly):
        floor = floors.get(spec.lengths_of)
        if floor is None or not _readable(arr):
            continue
        values = np.asarray(arr)
        bad = np.argwhere(values < floor.length)
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            raise SpecError(f"{path}{list(idx)} = {values[idx]}: lengths of {floor.var!r} must be "
                            f">= {floor.length} for this function: {floor.where} "
                            f"{floor.explain()}")


def check_raised_mins(call: BoundCall, raised: Mapping[str, Any]) -> None:
    """Refuse an unragged size below a min the plan raised (``raised``: per variable, a
    `_trace.RaisedMin`), before anything runs. Ragged rows below it run at their own lengths
    (`check_row_floors` refuses those a window would read past); a size no lengths input
    divides into rows is the length of every row, and the program was traced, by JAX's
    rule for the user's line, only for the longer ones."""
    if not raised:
        return
    ragged = {spec.lengths_of for spec, _ in call.signature.poly}
    for (spec, _), path in zip(call.signature.poly, call.signature.leaf_paths("poly")):
        for axis, dim in enumerate(spec.dims):
            need = raised.get(dim) if dim not in ragged else None
            if need is not None and call.sizes[dim] < need.min:
                raise SpecError(
                    f"{path}.shape[{axis}] = {call.sizes[dim]}: expected {dim} >= {need.min} for "
                    f"this function (declared min={need.declared}): {need.where} "
                    f"{need.explain()}; " + ("" if need.why else
                    f"give the lengths of the rows (a Spec with lengths_of={dim!r}) to run "
                    f"rows that short, or ") + f"declare px.LengthVar({dim!r}, min={need.min}, "
                    f"...)")


def bucket_shape(spec: Spec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(sizes[d] if isinstance(d, str) else d for d in spec.dims)


def pad_to(arr: Any, shape: Sequence[int], fill: Any, dtype: Any = None) -> np.ndarray:
    """``arr`` padded at the end of each axis with ``fill`` up to ``shape`` — the one padder of
    polyexec (inputs up to a bucket, training batches, values handed across a partition cut).

    Padding happens on the host with NumPy: padding a device array with jnp.pad would compile
    one small XLA program per exact input shape — the very recompilation bucketing avoids.

    >>> pad_to(np.array([[1, 2]]), (2, 3), fill=0).tolist()
    [[1, 2, 0], [0, 0, 0]]
    """
    host = np.asarray(arr, dtype)
    if tuple(host.shape) == tuple(shape):
        return host
    widths = [(0, t - s) for s, t in zip(host.shape, shape)]
    return np.pad(host, widths, mode="constant", constant_values=np.asarray(fill, host.dtype))


def pad(arr: Any, spec: Spec, dtype: np.dtype, bucket: Mapping[str, int]) -> Any:
    """Pad ``arr`` with ``spec.pad`` up to the bucket's shape (device arrays already at the
    bucket's shape are passed through untouched)."""
    target = bucket_shape(spec, bucket)
    if tuple(arr.shape) == target:
        return arr
    return pad_to(arr, target, spec.pad, dtype)


def pad_inputs(call: BoundCall, bucket: Mapping[str, int]) -> tuple[list[Any], int, int]:
    """The call's Spec'd leaves padded to ``bucket``, plus their real and padded element counts
    (for the stats).

    Real elements are honest about per-example lengths: along a variable that a ``lengths_of``
    input describes (``tokens: "B T"`` with ``lengths: "B"``, lengths_of T), an array counts
    ``sum(lengths)`` rows of T, not ``B * T``. The lengths arrays themselves are not counted.
    """
    flat = []
    real = padded = 0
    # A global array across processes cannot be read here: its rows count whole.
    lengths = {spec.lengths_of: (spec.dims, np.asarray(arr))
               for arr, (spec, _) in zip(call.poly, call.signature.poly)
               if spec.lengths_of and _readable(arr)}
    for arr, (spec, dtype), path in zip(call.poly, call.signature.poly,
                                        call.signature.leaf_paths("poly")):
        if (isinstance(arr, jax.Array) and not arr.is_fully_addressable
                and tuple(arr.shape) != bucket_shape(spec, bucket)):
            raise SpecError(
                f"{path}: a global array spanning several processes, of shape "
                f"{tuple(arr.shape)}, must already have its bucket's shape "
                f"{bucket_shape(spec, bucket)}: inputs are padded on the host, where no process "
                f"holds it whole. Pass process-local arrays, or pad each process's rows to the "
                f"bucket before forming the global array (as polyexec.training.fit does)")
        flat.append(pad(arr, spec, dtype, bucket))
        if spec.lengths_of:
            continue
        padded += int(np.prod(bucket_shape(spec, bucket)))
        real += _real_elements(spec, tuple(arr.shape), lengths)
    return flat, real, padded


def _readable(arr: Any) -> bool:
    return not isinstance(arr, jax.Array) or arr.is_fully_addressable


def _real_elements(spec: Spec, shape: tuple[int, ...], lengths: Mapping[str, Any]) -> int:
    for name, (dims, values) in lengths.items():
        n = len(dims)
        # The lengths array must index this array's leading axes, and T must follow them.
        if name in spec.dims and tuple(spec.dims[:n]) == tuple(dims) and spec.dims.index(name) >= n:
            axis = spec.dims.index(name)
            rest = int(np.prod([s for i, s in enumerate(shape) if i >= n and i != axis]))
            return int(np.minimum(values, shape[axis]).sum()) * rest
    return int(np.prod(shape))


def example_args(in_specs: Sequence[Any], variables: Mapping[str, LengthVar],
                 fixed: Sequence[Any], where: str) -> list[Any]:
    """A full call from the arguments without a Spec, with zeros at each variable's minimum
    standing in for the Spec'd ones (what `warmup` and `px.trace` trace with)."""
    positions = [i for i, s in enumerate(in_specs) if s is None]
    if len(fixed) != len(positions):
        raise SpecError(f"{where}: expected the {len(positions)} argument(s) without a Spec "
                        f"(in_specs positions {positions}) or a full example call of "
                        f"{len(in_specs)} arguments, received {len(fixed)}")
    given = iter(fixed)
    full = []
    for i, spec in enumerate(in_specs):
        if spec is None:
            full.append(next(given))
            continue
        leaves = jax.tree_util.tree_leaves(spec, is_leaf=_is_spec_leaf)
        if not all(isinstance(s, Spec) for s in leaves):
            # A None inside a pytree of Specs stands for arrays of the caller's own shapes.
            raise SpecError(f"{where}: in_specs[{i}] is a pytree holding None (arrays of their "
                            f"own shapes); expected a full example call")
        for s in leaves:
            if s.dtype is None:
                raise SpecError(f"{where}: in_specs[{i}] = {spec}: expected a dtype (or pass a "
                                f"full example call), received none")
        # Zeros at each variable's minimum, each leaf of a pytree of Specs its own.
        full.append(jax.tree_util.tree_map(
            lambda s: np.zeros(tuple(variables[d].min if isinstance(d, str) else d
                                     for d in s.dims), s.dtype), spec, is_leaf=_is_spec_leaf))
    return full


def unpad(arr: Any, spec: Spec, sizes: Mapping[str, int]) -> np.ndarray:
    """Slice an output back to the real sizes (on the host, for the same reason as `pad`)."""
    host = np.asarray(arr)
    index = tuple(slice(0, sizes[d]) if isinstance(d, str) else slice(None) for d in spec.dims)
    return host[index]


def check_warmup(sizes: Any, max_workers: Any, input_names: Sequence[str],
                 variables: Mapping[str, LengthVar], where: str) -> list[dict[str, int]] | None:
    """`Bucketed.warmup`'s options, checked before anything traces or compiles.

    ``sizes`` is None (every bucket) or a list of ``{name or LengthVar: size}`` dicts, one per
    bucket to compile: each names every input variable (``input_names``, which the inputs'
    shapes bind) and may name data-dependent ones (the rest of ``variables``); each size is an
    int in the variable's ``[min, max]``. Returns the dicts keyed by name, or None.

    >>> T = LengthVar("T", max=64)
    >>> check_warmup([{T: 10}], None, ["T"], {"T": T}, "f.warmup")
    [{'T': 10}]
    >>> check_warmup([{"T": 0}], None, ["T"], {"T": T}, "f.warmup")
    Traceback (most recent call last):
    polyexec._errors.SpecError: f.warmup: sizes[0]['T']: expected a size in [1, 64] (LengthVar('T', min=1, max=64)), received 0
    """
    if max_workers is not None and not (is_int(max_workers) and max_workers >= 1):
        raise OptionError(f"{where}: max_workers: expected an int >= 1 or None (one thread per "
                          f"bucket, up to the CPU count), received {max_workers!r}")
    if sizes is None:
        return None
    known = ", ".join(variables) or "none"
    if isinstance(sizes, Mapping):
        raise OptionError(f"{where}: sizes: expected a list of {{name: size}} dicts, one per "
                          f"bucket (e.g. sizes=[{dict(sizes)!r}]), received a single dict "
                          f"{dict(sizes)!r}")
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise OptionError(f"{where}: sizes: expected a list of {{name: size}} dicts, one per "
                          f"bucket, received {type(sizes).__name__} {sizes!r}")
    out = []
    for i, entry in enumerate(sizes):
        here = f"{where}: sizes[{i}]"
        if not isinstance(entry, Mapping):
            raise OptionError(f"{here}: expected a {{name: size}} dict over the variables "
                              f"({known}), received {type(entry).__name__} {entry!r}")
        combo: dict[str, int] = {}
        for key, size in entry.items():
            name = key.name if isinstance(key, LengthVar) else key
            if not isinstance(name, str) or name not in variables:
                raise OptionError(f"{here}: expected keys among this function's length variables "
                                  f"({known}), received {key!r}")
            var = variables[name]
            if isinstance(key, LengthVar) and key != var:
                raise OptionError(f"{here}: {key} is not this function's {var}")
            if not is_int(size):
                raise OptionError(f"{here}[{name!r}]: expected an int size, received "
                                  f"{type(size).__name__} {size!r}")
            if size > var.max:
                raise LengthOverflowError(f"{here}[{name!r}]: expected a size in [{var.min}, "
                                          f"{var.max}] ({var}), received {size}")
            if size < var.min:
                raise SpecError(f"{here}[{name!r}]: expected a size in [{var.min}, {var.max}] "
                                f"({var}), received {size}")
            combo[name] = int(size)
        missing = [n for n in input_names if n not in combo]
        if missing:
            raise OptionError(f"{here}: expected a size for every variable the inputs bind "
                              f"({', '.join(input_names)}), missing {', '.join(map(repr, missing))}"
                              f" in {dict(entry)!r}")
        out.append(combo)
    return out
