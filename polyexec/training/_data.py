"""Examples, the per-epoch batch order, and host-side padding to exact bucket shapes."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

import buckets as _buckets


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
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) and not isinstance(data, np.ndarray):
        raise TypeError(f"{where}: expected a sequence of examples (1-D integer arrays or bytes), "
                        f"received {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{where}: the dataset is empty")
    out = []
    for i, example in enumerate(data):
        if isinstance(example, (bytes, bytearray)):
            arr = np.frombuffer(bytes(example), np.uint8).astype(np.int32)
        else:
            arr = np.asarray(example)
            if arr.ndim != 1:
                raise ValueError(f"{where}[{i}]: expected a 1-D sequence of token ids, received "
                                 f"shape {arr.shape}")
            if arr.size == 0:
                raise ValueError(f"{where}[{i}]: empty example (length 0); drop it first")
            if arr.dtype.kind not in "iub":
                raise TypeError(f"{where}[{i}]: expected integer token ids, received dtype "
                                f"{arr.dtype.name}")
            arr = arr.astype(np.int32, copy=False)
        if arr.size == 0:
            raise ValueError(f"{where}[{i}]: empty example (length 0); drop it first")
        out.append(arr)
    lengths = np.fromiter((a.size for a in out), np.int64, count=len(out))
    return Examples(tuple(out), lengths)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Batching:
    """How examples become padded batches: the bucket policy and the rows per bucket.

    Every batch of bucket ``T`` is padded to exactly ``(rows(T), T)``: its remainder batch
    too, so each length bucket is one compiled shape (a compile costs seconds; the padded rows
    of one batch per bucket per epoch cost far less). ``rows`` is a multiple of the number of
    local devices so the batch axis splits evenly over them.
    """

    policy: Any
    batch_size: int | None
    max_tokens: int | None
    shuffle: bool
    seed: int
    device_multiple: int = 1
    num_shards: int = 1          # processes (multi-host): each takes its part of every step
    shard_index: int = 0

    def rows(self, bucket: int) -> int:
        b = self.batch_size if self.batch_size is not None else _buckets.batch_size_for(bucket, self.max_tokens)
        return round_up(b, self.device_multiple)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        return tuple(self.policy.sizes)

    def batch_buckets(self, used: Sequence[int] | None = None) -> tuple[int, ...]:
        return tuple(sorted({self.rows(s) for s in (used or self.length_buckets)}))

    def epoch(self, lengths: np.ndarray, epoch: int, *, shuffle: bool | None = None) -> list:
        """This process's batches of one epoch, deterministic in (seed, epoch)."""
        return _buckets.batch_plan(
            lengths, self.policy, batch_size=self.batch_size, max_tokens=self.max_tokens,
            shuffle=self.shuffle if shuffle is None else shuffle, seed=self.seed, epoch=epoch,
            num_shards=self.num_shards, shard_index=self.shard_index)


def pad_batch(examples: Examples, indices: np.ndarray, rows: int, length: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens (rows, length) int32, lengths (rows,) int32)``; extra rows have length 0.

    Padded on the host with NumPy into the exact bucket shape, so the executor neither pads
    nor compiles anything per exact size.
    """
    if len(indices) > rows:
        raise ValueError(f"pad_batch: {len(indices)} examples do not fit {rows} rows")
    tokens = np.full((rows, length), pad_id, np.int32)
    lengths = np.zeros((rows,), np.int32)
    for r, i in enumerate(indices):
        seq = examples.tokens[int(i)]
        if seq.size > length:
            raise ValueError(f"pad_batch: example {int(i)} has length {seq.size}, above the "
                             f"bucket {length}")
        tokens[r, :seq.size] = seq
        lengths[r] = seq.size
    return tokens, lengths
