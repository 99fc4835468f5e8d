"""Examples, the per-epoch batch order, and stacking a batch into arrays on the host."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

import buckets as _buckets

from .._bind import pad_to
from .._errors import OptionError


@dataclasses.dataclass(frozen=True)
class Examples:
    """Variable-length 1-D integer sequences (token ids) and their lengths."""

    tokens: tuple[np.ndarray, ...]
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    def fingerprint(self) -> str:
        """A short hash of the lengths: a checkpoint only resumes on the same data order."""
        return hashlib.sha256(self.lengths.astype(np.int64).tobytes()).hexdigest()[:16]


def as_examples(data: Any, where: str) -> Examples:
    """Validate a dataset: a sequence of 1-D integer arrays (or ``bytes``), none empty."""
    if isinstance(data, Examples):
        return data
    if isinstance(data, (str, bytes)) or not isinstance(data, (Sequence, np.ndarray)):
        raise OptionError(f"{where}: expected a sequence of examples (1-D integer arrays or "
                          f"bytes), received {type(data).__name__}")
    if len(data) == 0:
        raise OptionError(f"{where}: expected at least one example, received an empty "
                          f"{type(data).__name__}")
    out = []
    for i, example in enumerate(data):
        if isinstance(example, (bytes, bytearray)):
            arr = np.frombuffer(bytes(example), np.uint8).astype(np.int32)
        else:
            arr = np.asarray(example)
            if arr.ndim != 1:
                raise OptionError(f"{where}[{i}]: expected a 1-D sequence of token ids, received "
                                  f"shape {arr.shape}")
            if arr.size and arr.dtype.kind not in "iub":
                raise OptionError(f"{where}[{i}]: expected integer token ids, received dtype "
                                  f"{arr.dtype.name}")
            arr = arr.astype(np.int32, copy=False)
        if arr.size == 0:
            raise OptionError(f"{where}[{i}]: expected an example of length >= 1, received "
                              f"length 0; drop it first")
        out.append(arr)
    lengths = np.fromiter((a.size for a in out), np.int64, count=len(out))
    return Examples(tuple(out), lengths)


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
            partial_rows=partial_rows)

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

    def stack(self, examples: Examples, batch: _buckets.Batch,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``batch`` as ``(tokens (rows, length) int32, lengths (rows,) int32)`` (see above)."""
        if self.num_shards > 1:
            return pad_batch(examples, batch.indices, self.batch_rows(batch), batch.bucket_size,
                             pad_id)
        length = max(int(examples.lengths[batch.indices].max()), self.min_length)
        return pad_batch(examples, batch.indices, len(batch.indices), length, pad_id)


@dataclasses.dataclass(frozen=True)
class PackedBatching:
    """`Batching`'s counterpart for ``layout="pack"``: each step is a set of examples that
    `buckets.first_fit` fits into rows of one of ``row_lengths`` -- the shortest that holds
    them -- ``max_tokens // length`` rows a step (`buckets.packed_batch_plan`, deterministic in
    (seed, epoch)). A step reaches the train step as its examples stacked to their own longest;
    the executor packs them into the rows (several a row), so ``stats`` count the cells of the
    rows. One process, one device."""

    row_lengths: tuple[int, ...]
    max_tokens: int
    shuffle: bool
    seed: int
    min_length: int = 2

    policy = property(lambda self: _buckets.Fixed(self.row_lengths))
    length_buckets = property(lambda self: tuple(self.row_lengths))

    def rows(self, row_length: int) -> int:
        return max(1, self.max_tokens // row_length)

    def epoch(self, lengths: np.ndarray, epoch: int, *, shuffle: bool | None = None,
              partial_rows: Any = None) -> list:
        return _buckets.packed_batch_plan(
            np.maximum(lengths, self.min_length), self.row_lengths, max_tokens=self.max_tokens,
            shuffle=self.shuffle if shuffle is None else shuffle, seed=self.seed, epoch=epoch)

    def shape(self, batch: _buckets.PackedBatch) -> tuple[int, int]:
        return batch.rows, batch.row_length

    def shapes(self, lengths: np.ndarray, partial_rows: Any = None) -> dict[tuple[int, int], int]:
        """Every (rows, row length) an epoch runs at, and the real tokens each one carries."""
        at = self.policy.assign(np.maximum(lengths, self.min_length))
        return {(self.rows(n), n): int(np.sum(lengths[at == n]))
                for n in self.row_lengths if np.any(at == n)}

    def stack(self, examples: Examples, batch: _buckets.PackedBatch,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        length = max(int(examples.lengths[batch.indices].max()), self.min_length)
        return pad_batch(examples, batch.indices, len(batch.indices), length, pad_id)


def pad_batch(examples: Examples, indices: np.ndarray, rows: int, length: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens (rows, length) int32, lengths (rows,) int32)``; rows past the examples have
    length 0. Padded on the host by the executor's own padder, `pad_to`.

    >>> from polyexec.training import as_examples, pad_batch
    >>> tokens, lengths = pad_batch(as_examples([b"ab", b"c"], "data"), [1, 0], 3, 4, pad_id=0)
    >>> tokens.tolist(), lengths.tolist()
    ([[99, 0, 0, 0], [97, 98, 0, 0], [0, 0, 0, 0]], [1, 2, 0])
    """
    seqs = [examples.tokens[int(i)] for i in indices]
    if len(seqs) > rows:
        raise OptionError(f"pad_batch: rows: expected at least {len(seqs)} (one per example), "
                          f"received {rows}")
    longest = max((seq.size for seq in seqs), default=0)
    if longest > length:
        raise OptionError(f"pad_batch: length: expected at least {longest} (the longest example "
                          f"of the batch), received {length}")
    tokens = (np.stack([pad_to(seq, (length,), pad_id, np.int32) for seq in seqs]) if seqs
              else np.empty((0, length), np.int32))
    lengths = np.array([seq.size for seq in seqs], np.int32)
    return pad_to(tokens, (rows, length), pad_id), pad_to(lengths, (rows,), 0)
