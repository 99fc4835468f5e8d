"""Bucket policies: Optimal against brute force, invariants of every policy, errors, report."""

import dataclasses
import doctest
import io
import importlib
import itertools
import math
import pickle
import re
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import buckets
from buckets import BucketOverflowError, Fixed, Geometric, MultipleOf, Optimal


# ----------------------------------------------------------------------------- references


def total_padded(lengths, sizes):
    """Elements after padding every length to the smallest size >= it (independent code)."""
    sizes = sorted(sizes)
    return sum(next(s for s in sizes if s >= n) for n in lengths)


def all_boundary_sets(lengths):
    """Every bucket set made of distinct lengths that contains the maximum."""
    vals = sorted(set(lengths))
    for r in range(len(vals)):
        for subset in itertools.combinations(vals[:-1], r):
            yield subset + (vals[-1],)


def naive_dp(lengths, K):
    """O(K * D^2) textbook DP; returns [best total padded with exactly k buckets for k=1..K]."""
    vals, counts = np.unique(lengths, return_counts=True)
    D = len(vals)
    C = [0] + np.cumsum(counts).tolist()
    v = [0] + vals.tolist()
    inf = float("inf")
    F = [0] + [inf] * D
    out = []
    for _ in range(K):
        F = [inf] + [min(F[i] + v[j] * (C[j] - C[i]) for i in range(j)) for j in range(1, D + 1)]
        out.append(F[D])
    return out


small_lengths = st.lists(st.integers(1, 12), min_size=1, max_size=30)
medium_lengths = st.lists(st.integers(1, 400), min_size=1, max_size=300)


# ----------------------------------------------------------------------------- Optimal


@given(small_lengths, st.integers(1, 6))
def test_optimal_matches_brute_force(lengths, k):
    best = min(total_padded(lengths, s) for s in all_boundary_sets(lengths) if len(s) <= k)
    p = Optimal.fit(lengths, max_buckets=k)
    assert total_padded(lengths, p.sizes) == best
    assert len(p.sizes) == min(k, len(set(lengths)))  # more buckets always help until D
    assert set(p.sizes) <= set(lengths) and p.largest == max(lengths)


@given(medium_lengths, st.integers(1, 24))
def test_optimal_matches_naive_dp_on_larger_inputs(lengths, k):
    # Bigger D than brute force can enumerate: exercises every level of the vectorised
    # divide-and-conquer against the textbook O(K D^2) recurrence.
    p = Optimal.fit(lengths, max_buckets=k)
    assert total_padded(lengths, p.sizes) == min(naive_dp(lengths, k))


@given(small_lengths, st.sampled_from([0, 0.5, 1, 2, 3.25, 7, 20, 1000]))
def test_compile_cost_matches_brute_force_over_bucket_counts(lengths, cost):
    lam = Fraction(cost)
    want = min((total_padded(lengths, s) + lam * len(s), len(s)) for s in all_boundary_sets(lengths))
    p = Optimal.fit(lengths, compile_cost=cost)
    # Same objective and, on ties, the fewest buckets.
    assert (total_padded(lengths, p.sizes) + lam * len(p.sizes), len(p.sizes)) == want


@given(medium_lengths, st.integers(1, 12), st.sampled_from([0, 1.5, 40, 300, 5000, 10**6]))
def test_compile_cost_with_max_buckets(lengths, k, cost):
    lam = Fraction(cost)
    finals = naive_dp(lengths, k)
    want = min((finals[i] + lam * (i + 1), i + 1) for i in range(k) if finals[i] < float("inf"))
    p = Optimal.fit(lengths, max_buckets=k, compile_cost=cost)
    assert (total_padded(lengths, p.sizes) + lam * len(p.sizes), len(p.sizes)) == want
    if k >= len(set(lengths)):  # the unconstrained penalised pass gives the same optimum
        q = Optimal.fit(lengths, compile_cost=cost)
        assert (total_padded(lengths, q.sizes) + lam * len(q.sizes), len(q.sizes)) == want


def test_compile_cost_trades_compiles_for_padding():
    lengths = [5, 5, 6, 20]
    assert Optimal.fit(lengths, compile_cost=0).sizes == (5, 6, 20)  # padding is all that counts
    assert Optimal.fit(lengths, compile_cost=1).sizes == (5, 6, 20)  # splitting 5|6 saves 2 > 1
    assert Optimal.fit(lengths, compile_cost=2).sizes == (6, 20)  # tie: fewer buckets
    assert Optimal.fit(lengths, compile_cost=10**6).sizes == (20,)
    # Same tie with a bucket limit below the distinct count (the layered DP path):
    # (6, 21) costs 18 + 42 + 2*2 = 64, (5, 6, 21) costs 10 + 6 + 42 + 3*2 = 64.
    assert Optimal.fit([5, 5, 6, 20, 21], max_buckets=3, compile_cost=2).sizes == (6, 21)
    assert Optimal.fit([5, 5, 6, 20, 21], max_buckets=3, compile_cost=1.9).sizes == (5, 6, 21)


def test_default_is_eight_buckets():
    lengths = np.arange(1, 101)
    assert len(Optimal.fit(lengths).sizes) == 8
    assert Optimal.fit([3, 3, 7]).sizes == (3, 7)  # fewer distinct lengths than 8


def quantile_sizes(lengths, k):
    q = np.quantile(np.asarray(lengths), np.linspace(0, 1, k + 1)[1:], method="higher")
    return tuple(sorted(set(int(x) for x in q) | {max(lengths)}))


@given(medium_lengths, st.integers(1, 8), st.floats(1.2, 4.0))
def test_optimal_never_worse_than_geometric_or_quantiles(lengths, lo, ratio):
    eff = lambda sizes: sum(lengths) / total_padded(lengths, sizes)
    g = Geometric(min(lo, max(lengths)), max(lengths), ratio=ratio)
    assert Optimal.fit(lengths, max_buckets=len(g.sizes)).padding_efficiency(lengths) >= eff(g.sizes) - 1e-12
    for k in (1, 2, 4, 8):
        qs = quantile_sizes(lengths, k)
        assert Optimal.fit(lengths, max_buckets=len(qs)).padding_efficiency(lengths) >= eff(qs) - 1e-12


def test_optimal_is_fast():
    # 10^6 lengths, 10^4 distinct values. Measured ~0.06 s for 8 buckets on one core; a naive
    # O(K D^2) Python DP takes minutes, so a generous bound still catches a regression.
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(6.0, 1.2, 10**6)), 1, 10_000).astype(np.int64)
    lengths[:10_000] = np.arange(1, 10_001)
    assert np.unique(lengths).size == 10_000
    t = time.perf_counter()
    p = Optimal.fit(lengths, max_buckets=8)
    q = Optimal.fit(lengths, compile_cost=1e5)
    elapsed = time.perf_counter() - t
    assert len(p.sizes) == 8 and p.largest == 10_000 and q.largest == 10_000
    assert elapsed < 3.0, f"Optimal.fit took {elapsed:.2f} s"


# ----------------------------------------------------------------------------- invariants


policies = st.one_of(
    st.lists(st.integers(1, 300), min_size=1, max_size=8).map(Fixed),
    st.builds(lambda lo, extra, r: Geometric(lo, lo + extra, ratio=r),
              st.integers(1, 50), st.integers(0, 300), st.floats(1.05, 5.0)),
    st.builds(MultipleOf, st.integers(1, 64), st.integers(1, 300)),
    medium_lengths.flatmap(lambda L: st.integers(1, 10).map(lambda k: Optimal.fit(L, max_buckets=k))),
)


@given(policies, st.integers(0, 400))
def test_bucket_for_and_sizes_invariants(policy, n):
    sizes = policy.sizes
    assert isinstance(sizes, tuple) and all(type(s) is int and s >= 1 for s in sizes)
    assert list(sizes) == sorted(set(sizes))
    assert policy.largest == sizes[-1]
    if n <= sizes[-1]:
        b = policy.bucket_for(n)
        assert b in sizes and b >= n
        assert all(s < n for s in sizes if s < b)  # the smallest that fits
        assert policy.assign([n]).tolist() == [b]
    else:
        with pytest.raises(BucketOverflowError, match=rf"expected a length <= {sizes[-1]} \(the largest bucket size\), received {n}"):
            policy.bucket_for(n)


@given(st.integers(1, 100), st.integers(0, 2000), st.floats(1.01, 8.0))
def test_geometric_sizes(lo, extra, ratio):
    g = Geometric(lo, lo + extra, ratio=ratio)
    assert g.sizes[0] == lo and g.sizes[-1] == lo + extra
    # Sizes are ceil(lo * ratio**i): a = ceil(lo r^i) is in [lo r^i, lo r^i + 1), so the next
    # distinct size b lies in ((a - 1) * r, ceil(a * r)], and b > a.
    for a, b in zip(g.sizes[:-2], g.sizes[1:-1]):
        assert b > a and (a - 1) * ratio - 1e-6 * b < b <= math.ceil(a * ratio * (1 + 1e-12))


def test_geometric_examples():
    assert Geometric(1, 1024).sizes == tuple(2**i for i in range(11))
    assert Geometric(16, 1000).sizes == (16, 32, 64, 128, 256, 512, 1000)
    assert Geometric(3, 3).sizes == (3,)
    assert Geometric(16, 100, ratio=1.5).sizes == (16, 24, 36, 54, 81, 100)


@given(st.integers(1, 100), st.integers(1, 2000))
def test_multiple_of_sizes(k, hi):
    m = MultipleOf(k, hi)
    assert all(s % k == 0 for s in m.sizes)
    assert hi <= m.largest < hi + k
    assert m.sizes == tuple(range(k, m.largest + 1, k))


def test_policies_are_immutable_hashable_and_readable():
    p = Optimal.fit([1, 2, 3, 50], max_buckets=2)
    assert repr(p) == "Optimal(sizes=(3, 50))"
    assert repr(Fixed([64, 16])) == "Fixed(sizes=(16, 64))"
    assert repr(Geometric(16, 64)) == "Geometric(min=16, max=64, ratio=2.0)"
    assert repr(MultipleOf(8, 32)) == "MultipleOf(k=8, max=32)"
    for policy in (p, Fixed([4]), Geometric(1, 8), MultipleOf(2, 8)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            policy.sizes = (1,)
        assert pickle.loads(pickle.dumps(policy)) == policy
    assert Fixed([16, 64, 16]) == Fixed((64, 16)) and len({Fixed([16, 64]), Fixed((64, 16))}) == 1
    assert Optimal((4, 2)).sizes == (2, 4)


def test_as_policy():
    assert buckets.as_policy([32, 8]) == Fixed((8, 32))
    assert buckets.as_policy((8,)) == Fixed((8,))
    assert buckets.as_policy(np.array([8, 16])) == Fixed((8, 16))
    g = Geometric(2, 16)
    assert buckets.as_policy(g) is g
    with pytest.raises(TypeError, match="as_policy: expected a bucket policy .* or a list of sizes, received str"):
        buckets.as_policy("16,32")


def test_padding_efficiency():
    assert Fixed([4, 8]).padding_efficiency([2, 4, 8]) == 14 / 16
    assert Fixed([10]).padding_efficiency(np.array([10, 10])) == 1.0
    with pytest.raises(BucketOverflowError, match=r"example 1: expected a length <= 8 \(the largest bucket size\), received 9"):
        Fixed([4, 8]).padding_efficiency([2, 9])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call, exc, message", [
    (lambda: Optimal.fit([]), ValueError, r"Optimal.fit: lengths: expected at least one length, received none"),
    (lambda: Optimal.fit([3, 0, 2]), ValueError, r"Optimal.fit: lengths\[1\]: expected a length >= 1, received 0"),
    (lambda: Optimal.fit([3, -1]), ValueError, r"lengths\[1\]: expected a length >= 1, received -1"),
    (lambda: Optimal.fit([[1, 2]]), ValueError, r"lengths: expected a 1-D sequence of ints, received shape \(1, 2\)"),
    (lambda: Optimal.fit([1.5, 2.0]), TypeError, r"lengths: expected integers, received dtype float64"),
    (lambda: Optimal.fit([1, 2], max_buckets=0), ValueError, r"Optimal.fit: max_buckets: expected an int >= 1, received 0"),
    (lambda: Optimal.fit([1, 2], max_buckets=2.0), TypeError, r"max_buckets: expected an int, received float"),
    (lambda: Optimal.fit([1, 2], max_buckets=True), TypeError, r"max_buckets: expected an int, received bool"),
    (lambda: Optimal.fit([1, 2], compile_cost=-1), ValueError, r"compile_cost: expected a finite number >= 0, received -1"),
    (lambda: Optimal.fit([1, 2], compile_cost=float("inf")), ValueError, r"compile_cost: expected a finite number"),
    (lambda: Optimal.fit([1, 2], compile_cost="1s"), TypeError, r"compile_cost: expected a number >= 0"),
    (lambda: Geometric(1, 10, ratio=1.0), ValueError, r"Geometric: ratio: expected a finite number > 1, received 1.0"),
    (lambda: Geometric(1, 10, ratio=0.5), ValueError, r"ratio: expected a finite number > 1"),
    (lambda: Geometric(1, 10**9, ratio=1 + 1e-9), ValueError, r"received ratio=.*, which would need ~\d+ steps"),
    (lambda: Geometric(10, 5), ValueError, r"Geometric: max: expected max >= min=10, received 5"),
    (lambda: Geometric(0, 5), ValueError, r"Geometric: min: expected an int >= 1, received 0"),
    (lambda: Geometric(1.5, 5), TypeError, r"Geometric: min: expected an int, received float 1.5"),
    (lambda: MultipleOf(0, 5), ValueError, r"MultipleOf: k: expected an int >= 1, received 0"),
    (lambda: MultipleOf(1, 10**9), ValueError, r"MultipleOf: k: expected at most 100000 buckets up to max=1000000000, received k=1"),
    (lambda: Fixed([]), ValueError, r"Fixed: sizes: expected at least one bucket size, received none"),
    (lambda: Fixed([8, 0]), ValueError, r"Fixed: sizes\[1\]: expected an int >= 1, received 0"),
    (lambda: Fixed([8, "16"]), TypeError, r"Fixed: sizes\[1\]: expected an int, received str"),
    (lambda: Fixed(16), TypeError, r"Fixed: sizes: expected a sequence of ints, received int"),
    (lambda: Fixed([4]).bucket_for(-1), ValueError, r"Fixed.bucket_for: n: expected an int >= 0, received -1"),
    (lambda: Fixed([4]).bucket_for(5), BucketOverflowError, r"expected a length <= 4 \(the largest bucket size\), received 5"),
])
def test_errors_name_the_argument(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_overflow_error_is_a_value_error_with_fields():
    with pytest.raises(ValueError) as info:
        Fixed([8, 16]).assign([3, 20, 40])
    err = info.value
    assert isinstance(err, BucketOverflowError)
    assert (err.index, err.length, err.largest) == (1, 20, 16)
    again = pickle.loads(pickle.dumps(err))
    assert (again.index, again.length, again.largest, str(again)) == (1, 20, 16, str(err))


# ----------------------------------------------------------------------------- report


def test_report_numbers_and_table():
    lengths = [1, 3, 4, 9, 16, 16]
    r = buckets.report(lengths, [4, 8, 16])
    assert r.examples == 6 and r.real_tokens == 49
    assert r.padded_tokens == 4 * 3 + 16 * 3
    assert r.padding_efficiency == 49 / 60
    assert r.expected_compiles == 2 and r.unused_buckets == 1  # bucket 8 holds nothing
    assert [(b.size, b.examples, b.real_tokens, b.padded_tokens) for b in r.buckets] == [
        (4, 3, 8, 12), (16, 3, 41, 48)]
    text = str(r)
    assert text == r.to_table()
    assert "padding efficiency 0.817, 2 compiles (1 bucket unused)" in text
    assert "batch size" not in text
    assert len(text.splitlines()) == 2 + 1 + 2 + 1 + 1  # title, header, rule, rows, rule, total
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.padding_efficiency = 1.0


def test_report_with_token_budget():
    r = buckets.report([10] * 7 + [100] * 3, Fixed([16, 128]), max_tokens=256)
    assert [(b.size, b.batch_size, b.batches) for b in r.buckets] == [(16, 16, 1), (128, 2, 2)]
    assert "batch size" in str(r)
    with pytest.raises(ValueError, match="report: expected exactly one of batch_size="):
        buckets.report([1], [4], batch_size=2, max_tokens=8)
    with pytest.raises(BucketOverflowError, match="example 0: expected a length <= "):
        buckets.report([9], [4])


def test_report_rich_table():
    pytest.importorskip("rich")
    from rich.console import Console
    from rich.table import Table

    table = buckets.report([1, 3, 9], [4, 16], batch_size=2).rich_table()
    assert isinstance(table, Table) and table.row_count == 3
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(table)
    # 13 real tokens in 2x4 + 2x16 cells: the lone example of bucket 16 pads a second row.
    assert "0.325" in console.export_text()
    assert buckets.report([1, 3, 9], [4, 16]).padding_efficiency == 13 / 24  # length axis only
    assert buckets.report([1, 3, 9], [4, 16], batch_size=2,
                          partial_rows="exact").padding_efficiency == 13 / 24


# ----------------------------------------------------------------------------- corpus, docs


def test_pydoc_corpus():
    s = buckets.corpus.pydoc_sentences()
    raw, n_capped = buckets.corpus.lengths(s)
    assert n_capped == 0 and raw.dtype == np.int64 and raw.size == len(s)
    # DESIGN.md: 3,231 sentences, median 109, p99 ~690, max 4,523 (the text differs a little
    # between CPython releases: 3.10 gives 3,168, 3.11.7 3,242, 3.13 3,515).
    assert 3000 <= len(s) <= 3700
    assert 100 <= np.median(raw) <= 120
    assert 600 <= np.percentile(raw, 99) <= 760
    assert raw.max() >= 4000
    assert all(x == x.strip() and x for x in s)
    assert s == buckets.corpus.pydoc_sentences() and s is not buckets.corpus.pydoc_sentences()


def test_corpus_lengths_cap_counts_and_keeps_alignment():
    sentences = [b"ab", b"x" * 10, "é".encode(), b"y" * 4]
    lens, n_capped = buckets.corpus.lengths(sentences, cap=4)
    assert lens.tolist() == [2, 4, 2, 4] and n_capped == 1  # exactly cap is not capped
    with pytest.raises(ValueError, match="corpus.lengths: cap: expected an int >= 1, received 0"):
        buckets.corpus.lengths(sentences, cap=0)


@pytest.mark.parametrize("module", ["buckets", "buckets._policies", "buckets._batching",
                                    "buckets._stats", "buckets.corpus"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_public_surface():
    import pathlib

    assert all(hasattr(buckets, name) for name in buckets.__all__)
    public = {n for n, v in vars(buckets).items() if not n.startswith("_") and not hasattr(v, "__file__")}
    assert public - {"annotations"} <= set(buckets.__all__), public - set(buckets.__all__)
    # buckets must not depend on polyexec or jax (numpy only): no such import in its sources.
    for path in pathlib.Path(buckets.__file__).parent.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(jax|polyexec)\b", src, re.M), path


def test_no_module_imports_another_modules_private_names():
    # Shared helpers live under public names (argument checks in buckets/_checks.py, the batch
    # planner's global_steps/exact_sizes in _batching.py): a leading underscore means "this
    # module only", so an import of one from a sibling is a hidden coupling.
    import ast
    import pathlib

    for path in pathlib.Path(buckets.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from .{node.module}"
