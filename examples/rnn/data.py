"""The corpus for the example: sentences of ``pydoc_data.topics`` as bytes, capped and split."""

from __future__ import annotations

import dataclasses

import numpy as np

from buckets import corpus
import polyexec as px


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


# `fit`'s examples are ``{"tokens": (T,)}``; the Spec names T, so that a split whose sentences
# happen to share one length (a --limit run) is still read as sequences, and stacks the byte
# ids as int32.
SPECS = {"tokens": px.Spec("T", np.int32)}


def examples(sentences: list[bytes]) -> list[dict[str, np.ndarray]]:
    """`fit`'s examples of ``sentences``: one field, ``tokens``, each sentence's byte ids.

    >>> [e["tokens"].tolist() for e in examples([b"Hi", b"!"])]
    [[72, 105], [33]]
    """
    return [{"tokens": np.frombuffer(s, np.uint8)} for s in sentences]


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
        raise px.OptionError(f"load: cap: expected None or an int >= 2 (a sentence needs two bytes "
                             f"to predict one), received {cap}")
    if not 0.0 < val_fraction < 1.0:
        raise px.OptionError(f"load: val_fraction: expected a number in (0, 1), received "
                             f"{val_fraction}")
    sentences = corpus.pydoc_sentences()
    order = np.random.default_rng(split_seed).permutation(len(sentences))
    if limit is not None:
        if limit < 2:
            raise px.OptionError(f"load: limit: expected None or an int >= 2 (one train and one "
                                 f"validation sentence), received {limit}")
        order = order[:limit]
    chosen = [sentences[i] for i in order]
    capped = sum(len(s) > cap for s in chosen) if cap else 0
    removed = sum(max(len(s) - cap, 0) for s in chosen) if cap else 0
    if cap:
        chosen = [s[:cap] for s in chosen]
    n_val = max(1, int(round(len(chosen) * val_fraction)))
    return Corpus(train=chosen[n_val:], validation=chosen[:n_val], total=len(chosen),
                  capped=capped, bytes_removed=removed, cap=cap)
