"""Bucket policies: which padded sizes exist, and which one a length goes to.

Every policy is an immutable (frozen) dataclass with a sorted ``sizes`` tuple whose last
entry is the largest length it accepts. ``Optimal.fit`` chooses the sizes that minimise the
padded elements of a given length distribution exactly (dynamic programming over the
distinct lengths); the others are rules of thumb to compare it against.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from ._checks import check_int, lengths_array, normalise_sizes

__all__ = [
    "BucketOverflowError",
    "BucketPolicy",
    "Fixed",
    "Geometric",
    "MultipleOf",
    "Optimal",
    "as_policy",
]

# A policy with more sizes than this is a mistake (each size is a compile); it also bounds
# the memory a typo such as MultipleOf(1, 10**9) could take.
_MAX_SIZES = 100_000

# ``Optimal.fit`` without max_buckets or compile_cost: eight buckets. On the pydoc corpus
# (cap 1,024) eight exact-optimal buckets reach 0.83 padding efficiency against 0.71 for the
# eleven power-of-two buckets 1..1024, with eight compiles of the train step; doubling to 16
# buckets only adds 0.09 (0.91) for eight more compiles.
DEFAULT_MAX_BUCKETS = 8


class BucketOverflowError(ValueError):
    """A length is above the largest bucket of a policy.

    Attributes: ``length`` (the offending length), ``largest`` (the largest bucket size) and
    ``index`` (the example's position in the lengths given, or None for a single length).
    """

    def __init__(self, length: int, largest: int, index: int | None = None):
        self.length = int(length)
        self.largest = int(largest)
        self.index = None if index is None else int(index)
        msg = (f"expected a length <= {self.largest} (the largest bucket size), received "
               f"{self.length}")
        if index is not None:
            msg = (f"example {self.index}: {msg}; pass overflow='truncate' or 'exact', or use a "
                   f"policy whose largest size covers it")
        super().__init__(msg)

    def __reduce__(self):  # keep it picklable (multiprocessing data loaders)
        return (type(self), (self.length, self.largest, self.index))


# --------------------------------------------------------------------------- base class


class BucketPolicy:
    """Shared behaviour of every policy: ``sizes`` is a sorted tuple of distinct ints >= 1."""

    __slots__ = ()
    sizes: tuple[int, ...]

    @property
    def largest(self) -> int:
        """The largest bucket size: the longest length this policy accepts."""
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int:
        """The smallest bucket size >= ``n``.

        Raises BucketOverflowError (a ValueError) when ``n`` is above the largest size.

        >>> Fixed([8, 32, 128]).bucket_for(9)
        32
        """
        n = check_int(f"{type(self).__name__}.bucket_for", "n", n, minimum=0)
        sizes = self.sizes
        if n > sizes[-1]:
            raise BucketOverflowError(n, sizes[-1])
        # bisect on a tuple: a few hundred ns, cheaper than a numpy call per length.
        return sizes[bisect_left(sizes, n)]

    def assign(self, lengths) -> np.ndarray:
        """Vectorised ``bucket_for``: the bucket size of every length, as an int64 array.

        >>> Fixed([8, 32, 128]).assign([1, 8, 9, 100]).tolist()
        [8, 8, 32, 128]
        """
        arr = lengths_array(lengths, where=f"{type(self).__name__}.assign")
        sizes = np.asarray(self.sizes, dtype=np.int64)
        over = np.flatnonzero(arr > sizes[-1])
        if over.size:
            raise BucketOverflowError(arr[over[0]], sizes[-1], index=over[0])
        return sizes[np.searchsorted(sizes, arr, side="left")]

    def padding_efficiency(self, lengths) -> float:
        """Real elements over padded elements: ``sum(lengths) / sum(bucket_for(l))``.

        >>> Fixed([4, 8]).padding_efficiency([2, 4, 8])  # (2+4+8) / (4+4+8)
        0.875
        """
        arr = lengths_array(lengths, where=f"{type(self).__name__}.padding_efficiency")
        padded = int(self.assign(arr).sum())
        return float(arr.sum()) / padded


def as_policy(x) -> BucketPolicy:
    """A policy as is; a list/tuple/array of sizes becomes ``Fixed(sizes)``.

    >>> as_policy([64, 16, 256])
    Fixed(sizes=(16, 64, 256))
    """
    if isinstance(x, BucketPolicy):
        return x
    if isinstance(x, (list, tuple, np.ndarray, range)):
        return Fixed(tuple(x.tolist() if isinstance(x, np.ndarray) else x))
    raise TypeError(
        f"as_policy: expected a bucket policy (Auto, Fixed, Geometric, MultipleOf, Optimal) or a "
        f"list of sizes, received {type(x).__name__} {x!r}"
    )


# --------------------------------------------------------------------------- simple policies


@dataclass(frozen=True)
class Fixed(BucketPolicy):
    """Explicit bucket sizes (MIGraphX's "optimals").

    >>> p = Fixed([128, 32])
    >>> p.sizes, p.bucket_for(33)
    ((32, 128), 128)
    """

    sizes: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "sizes", normalise_sizes("Fixed", self.sizes))


@dataclass(frozen=True)
class Geometric(BucketPolicy):
    """Sizes ``ceil(min * ratio**i)`` below ``max``, then ``max`` itself.

    The largest size is exactly ``max`` (so it can equal a LengthVar's max); consecutive
    sizes that round to the same integer are merged.

    >>> Geometric(16, 1000).sizes
    (16, 32, 64, 128, 256, 512, 1000)
    >>> Geometric(1, 10, ratio=1.5).sizes
    (1, 2, 3, 4, 6, 8, 10)
    """

    min: int
    max: int
    ratio: float = 2.0
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        lo = check_int("Geometric", "min", self.min, minimum=1)
        hi = check_int("Geometric", "max", self.max, minimum=1)
        if hi < lo:
            raise ValueError(f"Geometric: max: expected max >= min={lo}, received {hi}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, numbers.Real):
            raise TypeError(f"Geometric: ratio: expected a number > 1, received {self.ratio!r}")
        ratio = float(self.ratio)
        if not math.isfinite(ratio) or ratio <= 1.0:
            raise ValueError(f"Geometric: ratio: expected a finite number > 1, received "
                             f"{self.ratio!r}")
        steps = math.log(hi / lo) / math.log(ratio) if hi > lo else 0.0
        if steps > _MAX_SIZES:
            raise ValueError(
                f"Geometric: ratio: expected a ratio far enough from 1 for min={lo}..max={hi}, "
                f"received ratio={ratio!r}, which would need ~{int(steps)} steps; use a larger "
                f"ratio (e.g. 1.1 or 2.0)"
            )
        sizes = []
        i = 0
        while True:
            x = lo * ratio**i
            r = round(x)
            # Float noise: 16 * 1.5**2 is 36.00000000000001, which must stay 36, not 37.
            s = r if abs(x - r) <= 1e-9 * x else math.ceil(x)
            if s >= hi:
                break
            if not sizes or s > sizes[-1]:
                sizes.append(int(s))
            i += 1
        sizes.append(hi)
        object.__setattr__(self, "min", lo)
        object.__setattr__(self, "max", hi)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "sizes", tuple(sizes))


@dataclass(frozen=True)
class MultipleOf(BucketPolicy):
    """Every multiple of ``k`` up to the first one >= ``max`` (hardware-aligned sizes).

    When ``max`` is not a multiple of ``k`` the largest size is ``k * ceil(max / k)``,
    i.e. above ``max``; pass a multiple of ``k`` when the largest bucket must equal a
    LengthVar's ``max``.

    >>> MultipleOf(64, 256).sizes
    (64, 128, 192, 256)
    >>> MultipleOf(64, 200).sizes
    (64, 128, 192, 256)
    """

    k: int
    max: int
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        k = check_int("MultipleOf", "k", self.k, minimum=1)
        hi = check_int("MultipleOf", "max", self.max, minimum=1)
        n = -(-hi // k)
        if n > _MAX_SIZES:
            raise ValueError(
                f"MultipleOf: k: expected at most {_MAX_SIZES} buckets up to max={hi}, received "
                f"k={k}, which would make {n}; use a larger k"
            )
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "max", hi)
        object.__setattr__(self, "sizes", tuple(range(k, n * k + 1, k)))


# --------------------------------------------------------------------------- Optimal


@dataclass(frozen=True)
class Optimal(BucketPolicy):
    """Bucket sizes fitted to a length distribution; build it with ``Optimal.fit``.

    >>> p = Optimal.fit([3, 3, 4, 10, 11, 12], max_buckets=2)
    >>> p
    Optimal(sizes=(4, 12))
    >>> round(p.padding_efficiency([3, 3, 4, 10, 11, 12]), 4)
    0.8958
    """

    sizes: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "sizes", normalise_sizes("Optimal", self.sizes))

    @classmethod
    def fit(cls, lengths, *, max_buckets: int | None = None, compile_cost=None) -> "Optimal":
        """The bucket sizes that minimise the padded elements of ``lengths`` exactly.

        Bucket boundaries are always at distinct lengths (moving a boundary down to the
        longest length it covers only removes padding), and the largest size is
        ``max(lengths)``. The cost of a bucket covering the distinct lengths ``(i..j]`` is
        ``size_j * count(i..j]``; the minimum over boundary sets is found exactly by
        dynamic programming over the D distinct lengths.

        - ``max_buckets=K``: at most K buckets (the optimum uses exactly ``min(K, D)``:
          splitting a bucket always removes padding).
        - ``compile_cost=c``: the padding one compile is worth, in elements; the bucket
          count minimises ``padded elements + c * n_buckets`` (ties go to fewer buckets).
        - both: the best count ``<= K`` under that objective.
        - neither: ``max_buckets=8`` (``DEFAULT_MAX_BUCKETS``).

        Cost: O(K * D log D) with vectorised numpy for ``max_buckets`` (divide-and-conquer
        row minima: the cost matrix is Monge, so optimal split points are monotone) and an
        O(D) exact-integer convex-hull pass for ``compile_cost`` alone. Measured on 10^6
        lognormal lengths with ~10^4 distinct values (one core): K=8 0.06 s, K=32 0.24 s,
        K=128 1.0 s; ``compile_cost`` alone 0.05 s (of which ~5 ms is counting lengths).

        >>> Optimal.fit([5, 5, 6, 20], max_buckets=2).sizes
        (6, 20)
        >>> Optimal.fit([5, 5, 6, 20], compile_cost=3).sizes   # a third bucket saves 2 < 3
        (6, 20)
        >>> Optimal.fit([5, 5, 6, 20], compile_cost=1).sizes
        (5, 6, 20)
        """
        where = "Optimal.fit"
        arr = lengths_array(lengths, where=where, minimum=1)
        if max_buckets is not None:
            max_buckets = check_int(where, "max_buckets", max_buckets, minimum=1)
        lam = None
        if compile_cost is not None:
            if isinstance(compile_cost, bool) or not isinstance(compile_cost, numbers.Real):
                raise TypeError(
                    f"{where}: compile_cost: expected a number >= 0 (padded elements one "
                    f"compile is worth), received {type(compile_cost).__name__} {compile_cost!r}"
                )
            if not math.isfinite(float(compile_cost)) or compile_cost < 0:
                raise ValueError(f"{where}: compile_cost: expected a finite number >= 0, received "
                                 f"{compile_cost!r}")
            lam = Fraction(compile_cost)  # exact: a float is a dyadic rational
        if max_buckets is None and lam is None:
            max_buckets = DEFAULT_MAX_BUCKETS

        values, counts = distinct_counts(arr)
        D = values.size
        if int(values[-1]) * int(arr.size) >= 2**62:
            # int64 DP below; this would need lengths ~1e9 with ~1e9 examples.
            raise ValueError(f"{where}: lengths: expected max(lengths) * len(lengths) < 2**62 "
                             f"(int64 arithmetic), received {int(values[-1])} * {int(arr.size)}")
        if lam is None:
            if max_buckets >= D:
                return cls(tuple(values.tolist()))
            return cls(_fit_k(values, counts, max_buckets))
        if max_buckets is None or max_buckets >= D:
            return cls(_fit_penalised(values, counts, lam))
        return cls(_fit_k(values, counts, max_buckets, lam=lam))


def distinct_counts(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and their counts; bincount (O(N)) when the range is small."""
    top = int(arr.max())
    if top <= 4 * arr.size + 4096:
        cnt = np.bincount(arr)
        values = np.flatnonzero(cnt)
        return values.astype(np.int64), cnt[values].astype(np.int64)
    values, counts = np.unique(arr, return_counts=True)
    return values.astype(np.int64), counts.astype(np.int64)


# The DP, with v[1..D] the distinct lengths ascending and C[j] = examples with length <= v[j]
# (C[0] = 0): F_k[j] = min_{k-1 <= i < j} F_{k-1}[i] + v[j] * (C[j] - C[i]) is the fewest padded
# elements covering the first j distinct lengths with k buckets. For rows j and columns i the
# matrix M[j, i] = F_{k-1}[i] + v[j] * (C[j] - C[i]) (+inf for i >= j) is Monge:
# M[j,i] + M[j',i'] - M[j,i'] - M[j',i] = (v[j'] - v[j]) * (C[i] - C[i']) <= 0 for j<j', i<i',
# so the leftmost row minimum moves right as j grows and each row's search can be confined to
# the columns between its neighbours' minima (divide and conquer). All arithmetic is int64:
# exact, so the result is the optimum, not an approximation.


def _rowmin_layer(prev: np.ndarray, v: np.ndarray, C: np.ndarray, rlo: int, rhi: int, clo: int):
    """Row minima of M for rows rlo..rhi (row j searches columns clo..j-1).

    Divide and conquer run breadth-first: every recursion level is one batch of numpy ops
    over all its sub-problems (about log2(D) levels, O(D) elements each), so Python
    overhead is ~15 numpy calls per level rather than per row.
    Returns (best, arg) arrays of length D+1 (entries outside rlo..rhi are unused).
    """
    D = v.size - 1
    best = np.zeros(D + 1, dtype=np.int64)
    arg = np.zeros(D + 1, dtype=np.int64)
    t_rlo = np.array([rlo], dtype=np.int64)
    t_rhi = np.array([rhi], dtype=np.int64)
    t_clo = np.array([clo], dtype=np.int64)
    t_chi = np.array([rhi - 1], dtype=np.int64)
    while t_rlo.size:
        mid = (t_rlo + t_rhi) // 2
        hi = np.minimum(t_chi, mid - 1)
        n = hi - t_clo + 1  # >= 1: clo <= rlo - 1 <= mid - 1 by construction
        T = n.size
        starts = np.cumsum(n) - n
        seg = np.repeat(np.arange(T), n)
        cols = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(t_clo - starts, n)
        vals = prev[cols] - v[mid][seg] * C[cols]
        segmin = np.minimum.reduceat(vals, starts)
        pos = np.flatnonzero(vals == segmin[seg])
        first = pos[np.concatenate(([True], seg[pos[1:]] != seg[pos[:-1]]))]  # leftmost argmin
        opt = cols[first]
        best[mid] = segmin + v[mid] * C[mid]
        arg[mid] = opt
        left = t_rlo <= mid - 1
        right = mid + 1 <= t_rhi
        t_rlo, t_rhi, t_clo, t_chi = (
            np.concatenate((t_rlo[left], (mid + 1)[right])),
            np.concatenate(((mid - 1)[left], t_rhi[right])),
            np.concatenate((t_clo[left], opt[right])),
            np.concatenate((opt[left], t_chi[right])),
        )
    return best, arg


def _fit_k(values: np.ndarray, counts: np.ndarray, K: int, *, lam: Fraction | None = None):
    """Exactly-optimal sizes with at most K < D buckets (and a compile penalty, if given)."""
    D = values.size
    v = np.concatenate(([0], values)).astype(np.int64)
    C = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    F = v * C  # layer 1: one bucket of size v[j] covers everything up to j
    finals = [int(F[D])]  # finals[k-1] = F_k[D]
    args = [None]  # args[k-1][j]: split point of layer k (layer 1 splits at 0)
    for k in range(2, K + 1):
        if k < K:
            # Rows beyond D-(K-k) can't lead to a K-bucket solution, but they do lead to a
            # k-bucket one, which the compile_cost comparison needs: keep all rows then.
            rhi = D if lam is not None else D - (K - k)
            best, arg = _rowmin_layer(F, v, C, k, rhi, k - 1)
        else:
            # The last layer only needs row D: a single vectorised min over its columns.
            i = np.arange(k - 1, D)
            cand = F[i] - v[D] * C[i]
            j = int(np.argmin(cand))
            best = np.zeros(D + 1, dtype=np.int64)
            arg = np.zeros(D + 1, dtype=np.int64)
            best[D] = cand[j] + v[D] * C[D]
            arg[D] = i[j]
        F = best
        finals.append(int(F[D]))
        args.append(arg)
    if lam is None:
        k_best = K
    else:
        # min over k of padded + lam * k, exactly (Fraction), ties to fewer buckets.
        k_best = min(range(1, K + 1), key=lambda k: (finals[k - 1] + lam * k, k))
    sizes = []
    j = D
    for k in range(k_best, 0, -1):
        sizes.append(int(v[j]))
        j = 0 if k == 1 else int(args[k - 1][j])
    return tuple(sorted(sizes))


def _fit_penalised(values: np.ndarray, counts: np.ndarray, lam: Fraction):
    """Exact optimum of ``padded + lam * n_buckets`` with any number of buckets, in O(D).

    G[j] = min_{i<j} G[i] + v[j] * (C[j] - C[i]) + lam. For fixed i the candidate is the line
    y = G[i] - C[i] * x at x = v[j]; slopes decrease with i and queries increase with j, so a
    monotone deque of lines (convex-hull trick) answers each j in amortised O(1). Everything
    is scaled to Python ints -- lam = p/q, cost*(D+1) + n_buckets -- so comparisons are exact
    and equal-cost solutions resolve to the fewest buckets.
    """
    D = values.size
    p, q = lam.numerator, lam.denominator
    A = (D + 1) * q  # scale of a padded element
    L = (D + 1) * p + 1  # scaled per-bucket cost: compile penalty plus the tie-break unit
    v = [0] + [int(x) * A for x in values.tolist()]
    C = [0]
    for c in counts.tolist():
        C.append(C[-1] + int(c))
    G = [0] * (D + 1)
    parent = [0] * (D + 1)
    # Deque of candidate split points, as a list with a moving head (no popleft cost).
    hull = [0]
    head = 0
    for j in range(1, D + 1):
        x = v[j]
        while head + 1 < len(hull):
            a, b = hull[head], hull[head + 1]
            if G[b] - C[b] * x <= G[a] - C[a] * x:
                head += 1
            else:
                break
        i = hull[head]
        G[j] = G[i] + x * (C[j] - C[i]) + L
        parent[j] = i
        # Insert line j; drop the back line while it is nowhere strictly below the others.
        mj, bj = -C[j], G[j]
        while len(hull) - head >= 2:
            l1, l2 = hull[-2], hull[-1]
            m1, b1, m2, b2 = -C[l1], G[l1], -C[l2], G[l2]
            # l2 useless iff x(l1 ∩ j) <= x(l1 ∩ l2); slopes strictly decrease, so the
            # denominators (m1 - m2), (m1 - mj) are positive and cross-multiplying is safe.
            if (bj - b1) * (m1 - m2) <= (b2 - b1) * (m1 - mj):
                hull.pop()
            else:
                break
        hull.append(j)
    sizes = []
    j = D
    while j > 0:
        sizes.append(int(values[j - 1]))
        j = parent[j]
    return tuple(sorted(sizes))
