"""Examples, the per-epoch batch order, and stacking a batch into arrays on the host.

An example is a pytree of arrays (``{"tokens": (T,), "label": (), "tags": (T,)}``) or, the
one-field shorthand, a bare 1-D array of token ids (or ``bytes``). `BatchForm` says what each
leaf's axes are -- ``T``, the example's length, or fixed sizes -- from Specs the caller
declares or, by default, from the examples themselves; a batch is the same pytree with a
leading ``B`` axis, its ``T`` axes padded to the batch's length. An example may have several
lengths (an encoder-decoder's ``{"src": (S,), "tgt": (T,)}``): each is an axis name of its
own, and each is padded to the batch's longest of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import buckets as _buckets

from .._bind import canonical_dtype, pad_to, spec_per_leaf
from .._errors import OptionError, SpecError
from .._spec import LengthVar, Spec

# The name of an example's length when it has one (the default; several are named apart).
LENGTH = "T"
APART = ("; to give them lengths of their own, name their axes apart with specs= (e.g. "
         "{'src': px.Spec('S'), 'tgt': px.Spec('T')})")


@dataclasses.dataclass(frozen=True)
class Field:
    """One leaf of an example: where it is (``path``, as in ``data[i]['tokens']``), its axes
    without the batch axis (``"T"`` for the example's length, ints for fixed sizes), the dtype
    it is stacked at and the value its padding holds."""

    path: str
    dims: tuple[str | int, ...]
    dtype: np.dtype
    pad: Any

    def shape(self, length: int | Mapping[str, int]) -> tuple[int, ...]:
        """The field's shape at ``length`` (one size for every length axis, or one per name)."""
        return tuple(d if not isinstance(d, str) else
                     length[d] if isinstance(length, Mapping) else length for d in self.dims)


@dataclasses.dataclass(frozen=True)
class BatchForm:
    """What the examples of a dataset are, and what their batches are: ``treedef`` of one
    example (None for the one-field shorthand, a bare 1-D array of token ids) and one `Field`
    per leaf, in flattening order.

    >>> import numpy as np
    >>> from polyexec.training import as_examples
    >>> data = [{"tokens": np.arange(n), "label": np.int32(n % 2)} for n in (3, 5, 4)]
    >>> form = as_examples(data, "data").form
    >>> [(f.path, f.dims) for f in form.fields]
    [("['label']", ()), ("['tokens']", ('T',))]
    >>> {k: v.shape for k, v in form.zeros(2, 8).items()}
    {'label': (2,), 'tokens': (2, 8)}
    """

    treedef: Any
    fields: tuple[Field, ...]
    # The names of an example's lengths, in the order `Examples.sizes` holds them.
    lengths: tuple[str, ...] = (LENGTH,)

    @property
    def one_field(self) -> bool:
        """The shorthand: each example a bare 1-D array of token ids, the batch ``(B, T)``."""
        return self.treedef is None

    @property
    def several(self) -> bool:
        """Whether an example has several lengths (a source and a target)."""
        return len(self.lengths) > 1

    @property
    def can_pack(self) -> bool:
        """Whether a packed row can hold these batches: every field with at most one length
        axis (a ``(T, T)`` field pairs positions, which the packed grid lays out per row)."""
        return all(sum(isinstance(d, str) for d in f.dims) <= 1 for f in self.fields)

    def specs(self, B: LengthVar, T: LengthVar | Mapping[str, LengthVar]) -> Any:
        """The batch's Specs: each field's with a leading ``B`` and its length axes' variables
        as given (one, or one per length name)."""
        named = T if isinstance(T, Mapping) else {n: T for n in self.lengths}
        specs = [Spec((B, *(named[d] if isinstance(d, str) else d for d in f.dims)), f.dtype,
                      pad=f.pad) for f in self.fields]
        return specs[0] if self.one_field else jax.tree_util.tree_unflatten(self.treedef, specs)

    def build(self, leaves: Sequence[np.ndarray]) -> Any:
        return leaves[0] if self.one_field else jax.tree_util.tree_unflatten(self.treedef,
                                                                             list(leaves))

    def step_sizes(self, shape: tuple[int, ...], processes: int = 1) -> dict[str, int]:
        """A batching's ``(rows, *sizes)`` (one process's rows) as a step's global sizes
        ``{"B": rows, name: size, ...}``."""
        return {"B": shape[0] * processes, **dict(zip(self.lengths, shape[1:]))}

    def zeros(self, rows: int, length: int | Mapping[str, int]) -> Any:
        """A batch of ``rows`` examples of length ``length`` (with several lengths, a mapping
        name -> size), every element its field's pad (what a measurement or a trace runs
        on)."""
        return self.build([np.full((rows, *f.shape(length)), f.pad, f.dtype)
                           for f in self.fields])

    def describe(self) -> str:
        return ", ".join(f"{f.path or 'tokens'}: ({' '.join(map(str, ('B', *f.dims)))}) "
                         f"{f.dtype.name}" for f in self.fields)


@dataclasses.dataclass(frozen=True)
class Examples:
    """Variable-length examples: each one's leaves (in `BatchForm` order), their lengths and
    their form. ``sizes`` ``(N, V)``: each example's size of each of ``form.lengths``;
    ``lengths`` ``(N,)``: its tokens -- its one length, or the sum of its several."""

    leaves: tuple[tuple[np.ndarray, ...], ...]
    lengths: np.ndarray
    form: BatchForm
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.leaves)

    @property
    def planned(self) -> np.ndarray:
        """What a batch plan reads: ``lengths``, or ``sizes`` for several lengths."""
        return self.sizes if self.form.several else self.lengths

    @property
    def tokens(self) -> tuple[np.ndarray, ...]:
        """The one-field shorthand's token arrays."""
        if not self.form.one_field:
            raise OptionError("Examples.tokens: expected examples that are 1-D token arrays, "
                              f"received pytrees ({self.form.describe()})")
        return tuple(leaves[0] for leaves in self.leaves)

    def fingerprint(self) -> str:
        """A short hash of the lengths: a checkpoint only resumes on the same data order."""
        return hashlib.sha256(self.planned.astype(np.int64).tobytes()).hexdigest()[:16]


def _is_token_sequence(example: Any) -> bool:
    """The one-field shorthand: bytes, a NumPy or JAX array, or a flat list or tuple of numbers
    (a pytree example is a dict, a tuple of arrays, a namedtuple, a dataclass, ...)."""
    if isinstance(example, (bytes, bytearray, np.ndarray, jax.Array)):
        return True
    return (type(example) in (list, tuple)
            and all(isinstance(x, (int, float, bool, np.number, np.bool_)) for x in example))


def _tokens(example: Any, where: str) -> np.ndarray:
    if isinstance(example, (bytes, bytearray)):
        return np.frombuffer(bytes(example), np.uint8).astype(np.int32)
    arr = np.asarray(example)
    if arr.ndim != 1:
        raise OptionError(f"{where}: expected a 1-D sequence of token ids, received shape "
                          f"{arr.shape} (an example with several fields is a dict or another "
                          f"pytree of arrays)")
    if arr.size and arr.dtype.kind not in "iub":
        raise OptionError(f"{where}: expected integer token ids, received dtype "
                          f"{arr.dtype.name}")
    return arr.astype(np.int32, copy=False)


def _leaf(leaf: Any, where: str) -> np.ndarray:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise OptionError(f"{where}: expected an array of numbers or bools, received a typed "
                          f"PRNG key (fit hands the loss a key per step: give loss_fn a "
                          f"parameter named key)")
    try:
        arr = np.asarray(leaf)
    except Exception as e:  # noqa: BLE001 -- ragged lists and the like
        raise OptionError(f"{where}: expected an array, received {type(leaf).__name__} "
                          f"({e})") from None
    if arr.dtype.kind not in "biuf":
        raise OptionError(f"{where}: expected an array of numbers or bools, received "
                          f"{type(leaf).__name__} of dtype {arr.dtype}")
    return arr


def as_examples(data: Any, where: str, specs: Any = None, *, also: Any = None,
                pad_id: int = 0, form: BatchForm | None = None) -> Examples:
    """Validate a dataset: a sequence of examples, each a 1-D integer array (or ``bytes``) --
    the one-field shorthand -- or a pytree of arrays of one structure, none of length 0.

    A pytree example's axes are named by ``specs`` (a pytree of ``px.Spec`` without the batch
    axis, a prefix of the example's structure: ``"T"`` marks the example's length, ints fixed
    sizes, None a leaf left to the default), else by default: a leaf's first axis is ``T``
    when its size varies across the examples (those of ``also`` too: the validation set of
    the same run, whose form must match), every other axis and every leaf that does not vary
    is fixed, a scalar is one value per example. Every ``T`` of an example has the same size,
    its length. Padding holds ``pad_id``, or a declared Spec's ``pad``. ``form``: the form
    the examples must have (the training set's, for its validation set).
    """
    if isinstance(data, Examples):
        return data
    if isinstance(data, (str, bytes)) or not isinstance(data, (Sequence, np.ndarray)):
        raise OptionError(f"{where}: expected a sequence of examples (1-D integer arrays, bytes "
                          f"or pytrees of arrays), received {type(data).__name__}")
    if len(data) == 0:
        raise OptionError(f"{where}: expected at least one example, received an empty "
                          f"{type(data).__name__}")
    if form is not None and not form.one_field:
        if _is_token_sequence(data[0]):
            raise OptionError(f"{where}[0]: expected an example like the training data's "
                              f"({form.describe()}), received a 1-D sequence")
        return _conform([_flat(e, form.treedef, f"{where}[{i}]") for i, e in enumerate(data)],
                        form, where)
    if _is_token_sequence(data[0]) or form is not None:
        if specs is not None:
            raise OptionError(f"fit: specs: expected None for examples that are 1-D token arrays "
                              f"(the one-field shorthand, batched as (B, T) int32); received "
                              f"{specs!r} (put each example in a dict to name its fields' axes)")
        leaves = []
        for i, example in enumerate(data):
            if not _is_token_sequence(example):
                raise OptionError(f"{where}[{i}]: expected a 1-D sequence of token ids like "
                                  f"{where}[0], received {type(example).__name__}")
            leaves.append((_tokens(example, f"{where}[{i}]"),))
        form = BatchForm(None, (Field("", (LENGTH,), np.dtype(np.int32), pad_id),))
        return _checked(leaves, np.fromiter((x[0].size for x in leaves), np.int64,
                                            count=len(leaves)), form, where)
    return _pytree_examples(data, where, specs, also, pad_id)


def _flat(example: Any, treedef: Any, where: str) -> list[tuple[str, np.ndarray]]:
    keyed, tree = jax.tree_util.tree_flatten_with_path(example)
    if treedef is not None and tree != treedef:
        raise OptionError(f"{where}: expected an example of the structure of the first, "
                          f"{treedef}, received {tree}")
    if not keyed:
        raise OptionError(f"{where}: expected a pytree of arrays, received "
                          f"{type(example).__name__} {example!r} with no array in it")
    return [(jax.tree_util.keystr(path), _leaf(leaf, f"{where}{jax.tree_util.keystr(path)}"))
            for path, leaf in keyed]


def _pytree_examples(data: Sequence[Any], where: str, specs: Any, also: Any,
                     pad_id: int) -> Examples:
    treedef = jax.tree_util.tree_structure(data[0])
    flat = [_flat(example, treedef, f"{where}[{i}]") for i, example in enumerate(data)]
    # The validation examples take part in the default: a leaf varies if it varies in either.
    others = []
    if also is not None and len(also) and not _is_token_sequence(also[0]):
        others = [[a for _, a in _flat(e, treedef, f"fit: validation[{i}]")]
                  for i, e in enumerate(also)]
    paths = [p for p, _ in flat[0]]
    declared = _declared(specs, data[0], [a for _, a in flat[0]], paths)
    fields = []
    for k, path in enumerate(paths):
        arrays = [leaves[k][1] for leaves in flat]
        fields.append(declared[k] if declared[k] is not None else
                      _inferred(path, arrays + [o[k] for o in others], where, pad_id))
    if not any(isinstance(d, str) for f in fields for d in f.dims):
        raise OptionError(
            f"{where}: expected a field whose first axis is the example's length (its size "
            f"varying across the examples), received none ({', '.join(map(_show, fields))}); "
            f"name it with specs=, e.g. specs={{'tokens': px.Spec('T')}}")
    fields = _named_apart(fields, [[a for _, a in e] for e in flat] + others, declared)
    names = tuple(dict.fromkeys(d for f in fields for d in f.dims if isinstance(d, str)))
    return _conform(flat, BatchForm(treedef, tuple(fields), names), where)


def _named_apart(fields: list[Field], examples: list[list[np.ndarray]],
                 declared: list[Field | None]) -> list[Field]:
    """The default's lengths: the leaves it found varying (their first axis ``T``) share one
    length where their sizes agree in every example, and have lengths of their own where they
    do not (an encoder-decoder's source and target), each named after its first leaf's key
    (``src``), else ``T1``, ``T2``, ... A declared Spec's names stand as given."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, field in enumerate(fields):
        if declared[k] is None and LENGTH in field.dims:
            groups.setdefault(tuple(int(e[k].shape[0]) for e in examples), []).append(k)
    if len(groups) <= 1:
        return fields
    taken = {d for f in declared if f is not None for d in f.dims if isinstance(d, str)}
    out = list(fields)
    for n, members in enumerate(groups.values(), start=1):
        key = fields[members[0]].path.rsplit("[", 1)[-1].strip("[]'\"")
        name = key if key.isidentifier() and key not in taken | {"B"} else f"T{n}"
        taken.add(name)
        for k in members:
            out[k] = dataclasses.replace(fields[k], dims=(name, *fields[k].dims[1:]))
    return out


def _conform(flat: list, form: BatchForm, where: str) -> Examples:
    """The examples (flattened, with their paths) checked against ``form`` and cast to it."""
    leaves, sizes = [], []
    for i, example in enumerate(flat):
        size: dict[str, tuple[int, str]] = {}    # each length: its size, and where it was read
        for field, (path, arr) in zip(form.fields, example):
            here = f"{where}[{i}]{path}"
            if arr.ndim != len(field.dims):
                raise OptionError(f"{here}: expected rank {len(field.dims)} ({_show(field)}), "
                                  f"received shape {arr.shape}")
            for axis, (d, n) in enumerate(zip(field.dims, arr.shape)):
                if isinstance(d, str) and d not in size:
                    size[d] = (n, f"{here}.shape[{axis}]")
                elif isinstance(d, str) and n != size[d][0]:
                    raise OptionError(f"{here}.shape[{axis}] = {n} disagrees with {size[d][1]} = "
                                      f"{size[d][0]}: both are the example's length {d}{APART}")
                elif not isinstance(d, str) and n != d:
                    raise OptionError(f"{here}.shape[{axis}]: expected {d} ({_show(field)}), "
                                      f"received {n}")
            if arr.dtype.kind != field.dtype.kind and not (
                    arr.dtype.kind in "iub" and field.dtype.kind in "iu"):
                raise OptionError(f"{here}.dtype: expected {field.dtype.name} ({_show(field)}), "
                                  f"received {arr.dtype.name}")
        leaves.append(tuple(arr.astype(field.dtype, copy=False)
                            for field, (_, arr) in zip(form.fields, example)))
        sizes.append([size[name][0] for name in form.lengths])
    sizes = np.asarray(sizes, np.int64).reshape(len(flat), len(form.lengths))
    return _checked(leaves, sizes.sum(axis=1), form, where, sizes)


def _show(field: Field) -> str:
    return f"{field.path}: ({' '.join(map(str, field.dims))})"


def _declared(specs: Any, example: Any, arrays: list[np.ndarray],
              paths: list[str]) -> list[Field | None]:
    """The fields ``specs`` declares (None where it leaves a leaf to the default)."""
    if specs is None:
        return [None] * len(paths)
    try:
        per_leaf = spec_per_leaf(_completed(specs, example), example, "fit: specs")
    except SpecError as e:
        raise OptionError(str(e)) from None
    out = []
    for path, spec, arr in zip(paths, per_leaf, arrays):
        if not isinstance(spec, Spec):
            out.append(None)
            continue
        names = [d for d in spec.dims if isinstance(d, str)]
        if "B" in names:
            raise OptionError(f"fit: specs{path}: expected dims naming the example's lengths "
                              f"(such as 'T', or 'S' and 'T' for two) and ints, without the "
                              f"batch axis B, received {spec}")
        dtype = canonical_dtype(spec.dtype if spec.dtype is not None else arr.dtype)
        out.append(Field(path, spec.dims, dtype, spec.pad))
    return out


def _completed(specs: Any, example: Any) -> Any:
    """``specs`` with the keys of ``example``'s dicts it leaves out set to None (the default):
    ``{"x": px.Spec("T T")}`` declares one field of a dict example."""
    if isinstance(specs, dict) and isinstance(example, dict):
        extra = [k for k in specs if k not in example]
        if extra:
            raise OptionError(f"fit: specs: expected keys of the examples ({', '.join(map(repr, example))}), "
                              f"received {', '.join(map(repr, extra))}")
        return {k: _completed(specs.get(k), v) for k, v in example.items()}
    return specs


def _inferred(path: str, arrays: list[np.ndarray], where: str, pad_id: int) -> Field:
    """The default: the first axis is ``T`` when its size varies across the examples."""
    first = arrays[0]
    dtype = canonical_dtype(first.dtype)
    for i, arr in enumerate(arrays):
        if arr.ndim != first.ndim:
            raise OptionError(f"{where}[{i}]{path}: expected rank {first.ndim} (as "
                              f"{where}[0]{path}), received shape {arr.shape}")
    if first.ndim == 0:
        return Field(path, (), dtype, pad_id)
    varies = [len({a.shape[axis] for a in arrays}) > 1 for axis in range(first.ndim)]
    if any(varies[1:]):
        axis = varies.index(True, 1)
        raise OptionError(f"{where}{path}.shape[{axis}]: expected the same size in every example "
                          f"(only a leaf's first axis is the length by default), received "
                          f"sizes {sorted({a.shape[axis] for a in arrays})}; declare the axes "
                          f"with specs=")
    dims = ((LENGTH,) if varies[0] else (first.shape[0],)) + tuple(first.shape[1:])
    return Field(path, dims, dtype, pad_id)


def _checked(leaves: list, lengths: np.ndarray, form: BatchForm, where: str,
             sizes: np.ndarray | None = None) -> Examples:
    sizes = lengths.reshape(-1, 1) if sizes is None else sizes
    empty = np.argwhere(sizes == 0)
    if empty.size:
        i, v = (int(x) for x in empty[0])
        what = "length" if not form.several else f"length {form.lengths[v]}"
        raise OptionError(f"{where}[{i}]: expected an example of {what} >= 1, received "
                          f"{what} 0; drop it first")
    return Examples(tuple(leaves), lengths, form, sizes)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Batching:
    """How examples become batches: the bucket policy, the rows of each batch, the time axis.

    A bucket's full batches have ``rows(T)`` rows; its last, partial batch runs either at as
    many or, for the buckets in the policy's ``partial_rows`` (chosen by cost, see
    `buckets.Auto`), at just the rows it needs -- one more compiled shape. Rows are a multiple
    of the number of local devices so the batch axis splits evenly over them.

    On one process a batch is stacked as its real rows only, at the batch's own longest
    example (at least ``min_length``), and the executor pads both axes up to `shape`: its
    padded rows are no rows, so a mean over the rows divides by the real ones, and its
    ``stats`` count the padding. Across processes the global batch is assembled from equal
    local shares and must arrive at the bucket's shape, so there each share is stacked at the
    bucket's time axis and its rows are filled with zero-length rows, which a loss that
    averages per-row values over the rows counts as rows.
    """

    policy: Any
    batch_size: int | None
    max_tokens: int | None
    shuffle: bool
    seed: int
    min_length: int = 2
    device_multiple: int = 1
    num_shards: int = 1          # processes (multi-host): each takes its part of every step
    shard_index: int = 0
    # Every batch at its own rows, a partial one too (masking=False: a loss that masks the
    # padding itself cannot tell a filler row from an example, so none is added).
    exact_rows: bool = False

    def rows(self, bucket: int) -> int:
        """The rows of a full batch of length bucket ``bucket`` (this process's share)."""
        b = self.batch_size if self.batch_size is not None else _buckets.batch_size_for(bucket, self.max_tokens)
        return round_up(b, self.device_multiple)

    def batch_rows(self, batch: _buckets.Batch) -> int:
        return round_up(batch.rows, self.device_multiple)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        return tuple(self.policy.sizes)

    def epoch(self, lengths: np.ndarray, epoch: int, *, shuffle: bool | None = None,
              partial_rows: Any = None) -> list:
        """This process's batches of one epoch, deterministic in (seed, epoch)."""
        return _buckets.batch_plan(
            lengths, self.policy, batch_size=self.batch_size, max_tokens=self.max_tokens,
            shuffle=self.shuffle if shuffle is None else shuffle, seed=self.seed, epoch=epoch,
            num_shards=self.num_shards, shard_index=self.shard_index,
            partial_rows="exact" if self.exact_rows else partial_rows)

    def shapes(self, lengths: np.ndarray, partial_rows: Any = None) -> dict[tuple[int, int], int]:
        """Every (rows, length bucket) an epoch runs at -- the same every epoch -- and the real
        tokens each one carries (this process's share)."""
        out: dict[tuple[int, int], int] = {}
        for batch in self.epoch(lengths, 0, shuffle=False, partial_rows=partial_rows):
            key = (self.batch_rows(batch), batch.bucket_size)
            out[key] = out.get(key, 0) + int(lengths[batch.indices].sum())
        return out

    def shape(self, batch: _buckets.Batch) -> tuple[int, int]:
        """The (rows, length) bucket ``batch`` runs at (this process's share)."""
        return self.batch_rows(batch), batch.bucket_size

    def stack(self, examples: Examples, batch: _buckets.Batch) -> tuple[Any, np.ndarray]:
        """``batch`` as ``(the examples' pytree with a leading rows axis, lengths (rows,)
        int32)`` (see above; the one-field shorthand's batch is tokens (rows, length) int32)."""
        if self.num_shards > 1:
            return pad_batch(examples, batch.indices, self.batch_rows(batch), batch.bucket_size)
        length = max(int(examples.lengths[batch.indices].max()), self.min_length)
        return pad_batch(examples, batch.indices, len(batch.indices), length)


@dataclasses.dataclass(frozen=True)
class PackedBatching:
    """`Batching`'s counterpart for ``layout="pack"``: each step is a set of examples that
    `buckets.first_fit` fits into rows of one of ``row_lengths`` -- the shortest that holds
    them -- ``max_tokens // length`` rows a step (`buckets.packed_batch_plan`, deterministic in
    (seed, epoch)). A step reaches the train step as its examples stacked to their own longest;
    the executor packs them into the rows (several a row), so ``stats`` count the cells of the
    rows, and splits the rows over the devices, whole rows each.

    Across processes (``num_shards``) the plan is global -- every process plans the same
    steps, ``max_tokens`` the cells of a whole step -- and so is the grid: process ``i``
    holds rows ``[i * R / P, (i + 1) * R / P)`` of its ``R`` rows. Each process stacks every
    example's length but loads only the examples packed into its own rows (``rows_of``, the
    step's `Bucketed.packing_of`): the shares are disjoint and together hold each example of
    a step once, and the grid is the one a single process would run. ``rows`` and `shape`
    give this process's share of the rows, as `Batching`'s do.

    The steps do not depend on the process count: ``max_tokens`` plans them, and the grid
    rounds each row length's rows up to ``row_multiple`` (the run's devices, which split the
    rows whole) with rows no example is packed into. So one process with a budget and two
    with half of it each take the same examples at every step, even where the rows a budget
    holds do not split evenly."""

    row_lengths: tuple[int, ...]
    max_tokens: int
    shuffle: bool
    seed: int
    min_length: int = 2
    num_shards: int = 1
    shard_index: int = 0
    # The cells each example takes after its own (the step's `Plan.packing_room`): the plan
    # counts them as the executor packs them, so a step's rows are the rows that run.
    room: int = 0
    row_multiple: int = 1

    policy = property(lambda self: _buckets.Fixed(self.row_lengths))
    length_buckets = property(lambda self: tuple(self.row_lengths))

    @property
    def pack_rows(self) -> dict[int, int]:
        """The rows of a whole step (every process's) per row length: the train step's
        ``pack_rows``, and what a checkpoint keeps of the choice."""
        return {n: round_up(max(1, self.max_tokens // n), self.row_multiple)
                for n in self.row_lengths}

    def rows(self, row_length: int) -> int:
        """This process's share of a step's rows."""
        return self.pack_rows[row_length] // self.num_shards

    def epoch(self, lengths: np.ndarray, epoch: int, *, shuffle: bool | None = None,
              partial_rows: Any = None) -> list:
        return _buckets.packed_batch_plan(
            np.maximum(lengths, self.min_length), self.row_lengths, max_tokens=self.max_tokens,
            shuffle=self.shuffle if shuffle is None else shuffle, seed=self.seed, epoch=epoch,
            room=self.room)

    def shape(self, batch: _buckets.PackedBatch) -> tuple[int, int]:
        return self.rows(batch.row_length), batch.row_length

    def shapes(self, lengths: np.ndarray, partial_rows: Any = None) -> dict[tuple[int, int], int]:
        """Every (rows, row length) an epoch runs at, and the real tokens each one carries: from
        the plan itself, since a longer row length's steps take shorter examples into the
        cells they leave free (`buckets.packed_batch_plan`), and may take all of a row length's
        (whose shape then needs no compile)."""
        out: dict[tuple[int, int], int] = {}
        for batch in self.epoch(lengths, 0, shuffle=False):
            key = self.shape(batch)
            out[key] = out.get(key, 0) + int(lengths[batch.indices].sum())
        return out

    def stack(self, examples: Examples, batch: _buckets.PackedBatch,
              rows_of: Any = None) -> tuple[Any, np.ndarray]:
        """The step's examples stacked (every one's length; across processes, the data of
        this process's rows only: ``rows_of(lengths) -> (row of each, rows)``)."""
        length = max(int(examples.lengths[batch.indices].max()), self.min_length)
        load = None
        if self.num_shards > 1:
            if rows_of is None:
                raise OptionError("PackedBatching.stack: rows_of: expected the step's "
                                  "packing_of across processes, received None")
            row, rows = rows_of(examples.lengths[batch.indices])
            share = rows // self.num_shards
            load = np.asarray(row) // share == self.shard_index
        return pad_batch(examples, batch.indices, len(batch.indices), length, load=load)


def pad_batch(examples: Examples, indices: np.ndarray, rows: int,
              length: int | Mapping[str, int], pad_id: int | None = None,
              load: Sequence[bool] | None = None) -> tuple[Any, Any]:
    """``(batch, lengths (rows,) int32)``: the examples stacked along a leading rows axis,
    each length axis padded to ``length`` and the rows past the examples (length 0) filled
    with each field's pad (``pad_id``, when given, for every field). The one-field shorthand's
    batch is tokens ``(rows, length)`` int32. Padded on the host by the executor's own padder,
    `pad_to`. Examples of several lengths take ``length`` per name and give ``lengths`` as
    ``{name: (rows,) int32}``.
    ``load``: per example, whether to read it; an example not read keeps its length and its
    row holds the pad (another process holds it: `PackedBatching`).

    >>> from polyexec.training import as_examples, pad_batch
    >>> tokens, lengths = pad_batch(as_examples([b"ab", b"c"], "data"), [1, 0], 3, 4)
    >>> tokens.tolist(), lengths.tolist()
    ([[99, 0, 0, 0], [97, 98, 0, 0], [0, 0, 0, 0]], [1, 2, 0])
    """
    indices = [int(i) for i in indices]
    if len(indices) > rows:
        raise OptionError(f"pad_batch: rows: expected at least {len(indices)} (one per example), "
                          f"received {rows}")
    form = examples.form
    names = form.lengths
    length = dict(length) if isinstance(length, Mapping) else {n: length for n in names}
    for v, name in enumerate(names):
        longest = max((int(examples.sizes[i, v]) for i in indices), default=0)
        if longest > length[name]:
            axis = "" if not form.several else f"[{name!r}]"
            raise OptionError(f"pad_batch: length{axis}: expected at least {longest} (the "
                              f"longest example of the batch), received {length[name]}")
    stacked = []
    for k, field in enumerate(form.fields):
        if pad_id is not None:
            field = dataclasses.replace(field, pad=pad_id)
        shape = field.shape(length)
        parts = [pad_to(examples.leaves[i][k], shape, field.pad, field.dtype)
                 if load is None or load[j] else np.full(shape, field.pad, field.dtype)
                 for j, i in enumerate(indices)]
        block = np.stack(parts) if parts else np.empty((0, *shape), field.dtype)
        stacked.append(pad_to(block, (rows, *shape), field.pad))
    sizes = {name: pad_to(np.array([examples.sizes[i, v] for i in indices], np.int32),
                          (rows,), 0) for v, name in enumerate(names)}
    return form.build(stacked), (sizes if form.several else sizes[names[0]])
