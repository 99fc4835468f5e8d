"""The real corpus used across the project: the sentences of ``pydoc_data.topics``.

``pydoc_data.topics`` ships with CPython (the text behind ``help("topics")``), so the corpus
needs no download. Splitting rule: each topic's text (in the module's dict order) is split
at whitespace that follows ``.``, ``!`` or ``?`` -- ``re.split(r"(?<=[.!?])\\s+", text)`` --
each piece is stripped, empty pieces are dropped, and the rest are UTF-8 encoded. Code
blocks and tables have no sentence ends, so they stay inside one "sentence": that is the long
tail. Measured (``python3 -c "from buckets import corpus; ..."``):

=================  =========  ======  ========  =====
CPython            sentences  median  p99       max
=================  =========  ======  ========  =====
3.11.7             3,242      109     677.8     4,523
3.11.2             3,236      109     673.9     4,523
3.10.13            3,168      110     670.0     4,523
3.12.1             3,410      109     689.9     5,214
3.13.0             3,515      109     701.6     4,725
=================  =========  ======  ========  =====

(bytes; p99 by linear interpolation). The design's 3,231 / 109 / ~690 / 4,523 was
presumably measured on another 3.11 patch release: the topics text changes between patch
releases, so counts move by a few (no rule tried here gives exactly 3,231 on 3.11.7).
Splitting on ``.`` only gives 3,235 on 3.11.7; splitting at blank lines too gives 4,501
with median 81, further from the design's numbers.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple, Sequence

import numpy as np

from ._checks import check_int

__all__ = ["CappedLengths", "lengths", "pydoc_sentences"]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=1)
def _sentences() -> tuple[bytes, ...]:
    from pydoc_data.topics import topics

    out = []
    for text in topics.values():
        for piece in _SENTENCE_END.split(text):
            piece = piece.strip()
            if piece:
                out.append(piece.encode("utf-8"))
    return tuple(out)


def pydoc_sentences() -> list[bytes]:
    """The sentences of ``pydoc_data.topics`` as UTF-8 bytes (a new list each call).

    >>> s = pydoc_sentences()
    >>> len(s) > 3000, all(isinstance(x, bytes) and x for x in s)
    (True, True)
    """
    return list(_sentences())


class CappedLengths(NamedTuple):
    """``lengths[i]`` is ``min(len(sentences[i]), cap)``; ``n_capped`` sentences were longer."""

    lengths: np.ndarray
    n_capped: int


def lengths(sentences: Sequence, cap: int | None = None) -> CappedLengths:
    """Byte lengths of ``sentences`` (int64), and how many exceeded ``cap``.

    Capping clips: a sentence longer than ``cap`` gets length ``cap`` (the caller truncates
    it, ``s[:cap]``) and is counted in ``n_capped``, so the array stays aligned with
    ``sentences`` and nothing is dropped. To drop instead, keep the indices with
    ``lengths(sentences).lengths <= cap``.

    >>> lens, n_capped = lengths([b"abc", b"a" * 10, b""], cap=4)
    >>> lens.tolist(), n_capped
    ([3, 4, 0], 1)
    """
    raw = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
    if cap is None:
        return CappedLengths(raw, 0)
    cap = check_int("corpus.lengths", "cap", cap, minimum=1)
    over = raw > cap
    return CappedLengths(np.minimum(raw, cap), int(over.sum()))
