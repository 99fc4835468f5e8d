"""The corpus for the example: sentences of ``pydoc_data.topics`` as bytes, capped and split."""

from __future__ import annotations

import dataclasses

import numpy as np

from buckets import corpus


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation sentences (bytes) and what the length cap did."""

    train: list[bytes]
    validation: list[bytes]
    total: int               # sentences before the split
    capped: int              # sentences longer than the cap, truncated to it
    bytes_removed: int       # bytes the truncation removed
    cap: int | None

    def describe(self) -> str:
        train_bytes = sum(map(len, self.train))
        cap = (f"cap {self.cap}: {self.capped} sentence(s) truncated ({self.bytes_removed:,} bytes "
               f"removed, none dropped)" if self.cap else "no cap")
        return (f"corpus: {self.total:,} sentences of pydoc_data.topics -> {len(self.train):,} train "
                f"({train_bytes:,} bytes), {len(self.validation):,} validation; {cap}")


def load(*, cap: int | None = 1024, limit: int | None = None, val_fraction: float = 0.1,
         split_seed: int = 0) -> Corpus:
    """Sentences capped at ``cap`` bytes (truncated, so nothing is dropped), optionally the
    first ``limit`` of a fixed shuffle, split deterministically into train and validation.

    The split depends only on ``split_seed`` (not on the training seed), so validation losses
    of different runs compare on the same sentences.

    >>> c = load(cap=64, limit=100)
    >>> len(c.train) + len(c.validation), max(map(len, c.train)) <= 64
    (100, True)
    """
    if cap is not None and cap < 2:
        raise ValueError(f"load: cap must be >= 2 (a sentence needs two bytes to predict one), got {cap}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"load: val_fraction must be in (0, 1), got {val_fraction}")
    sentences = corpus.pydoc_sentences()
    order = np.random.default_rng(split_seed).permutation(len(sentences))
    if limit is not None:
        if limit < 2:
            raise ValueError(f"load: limit must be >= 2 (one train and one validation sentence), got {limit}")
        order = order[:limit]
    chosen = [sentences[i] for i in order]
    capped = sum(len(s) > cap for s in chosen) if cap else 0
    removed = sum(max(len(s) - cap, 0) for s in chosen) if cap else 0
    if cap:
        chosen = [s[:cap] for s in chosen]
    n_val = max(1, int(round(len(chosen) * val_fraction)))
    return Corpus(train=chosen[n_val:], validation=chosen[:n_val], total=len(chosen),
                  capped=capped, bytes_removed=removed, cap=cap)
