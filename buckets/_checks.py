"""Argument checks shared by every module of `buckets`: one wording everywhere,
``<where>: <name>: expected <what>, received <value>``, as ValueError/TypeError (buckets has no
dependency on polyexec, so not its error classes).
"""

from __future__ import annotations

import numbers
from typing import Iterable

import numpy as np


def check_int(where: str, name: str, value, *, minimum: int) -> int:
    # bool is an int subclass: reject it, True as a size is always a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name}: expected an int, received {type(value).__name__} "
                        f"{value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{where}: {name}: expected an int >= {minimum}, received {value}")
    return value


def lengths_array(lengths, *, where: str, name: str = "lengths", minimum: int = 0) -> np.ndarray:
    """``lengths`` as a 1-D int64 array, or a ValueError/TypeError naming the argument."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{where}: {name}: expected a 1-D sequence of ints, received shape "
                         f"{arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{where}: {name}: expected at least one length, received none")
    if arr.dtype.kind not in "iu":
        # No silent float->int rounding: a float length usually means a unit mix-up.
        raise TypeError(
            f"{where}: {name}: expected integers, received dtype {arr.dtype}"
            f" (cast with np.asarray({name}, dtype=np.int64) if that is what you mean)"
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}: {name}: expected values within int64, received {arr.max()}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < minimum)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{where}: {name}[{i}]: expected a length >= {minimum}, received {int(arr[i])}"
            f" ({bad.size} such value{'s' if bad.size > 1 else ''})"
        )
    return arr


def normalise_sizes(where: str, sizes) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"{where}: sizes: expected a sequence of ints, received "
                        f"{type(sizes).__name__}")
    out = []
    for i, s in enumerate(sizes):
        out.append(check_int(where, f"sizes[{i}]", s, minimum=1))
    if not out:
        raise ValueError(f"{where}: sizes: expected at least one bucket size, received none")
    # Sorted and de-duplicated so that equal policies compare (and hash) equal.
    return tuple(sorted(set(out)))


def check_option(where: str, name: str, value, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(
            f"{where}: {name}: expected one of {', '.join(repr(o) for o in options)}, "
            f"received {value!r}"
        )
    return value


def check_bool(where: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name}: expected True or False, received {value!r}")
    return bool(value)


def check_batching(where: str, batch_size, max_tokens) -> tuple[int | None, int | None]:
    if (batch_size is None) == (max_tokens is None):
        raise ValueError(
            f"{where}: expected exactly one of batch_size= (examples per batch) or max_tokens= "
            f"(bucket_size * examples per batch), received batch_size={batch_size!r}, "
            f"max_tokens={max_tokens!r}"
        )
    if batch_size is not None:
        batch_size = check_int(where, "batch_size", batch_size, minimum=1)
    if max_tokens is not None:
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
    return batch_size, max_tokens


def check_epoch_shard(where: str, seed, epoch, num_shards, shard_index) -> tuple[int, int, int, int]:
    """``(seed, epoch, num_shards, shard_index)`` of a batch plan, checked: the shard within
    ``[0, num_shards)``."""
    seed = check_int(where, "seed", seed, minimum=0)
    epoch = check_int(where, "epoch", epoch, minimum=0)
    num_shards = check_int(where, "num_shards", num_shards, minimum=1)
    shard_index = check_int(where, "shard_index", shard_index, minimum=0)
    if shard_index >= num_shards:
        raise ValueError(f"{where}: shard_index: expected an int in [0, num_shards="
                         f"{num_shards}), received {shard_index}")
    return seed, epoch, num_shards, shard_index
