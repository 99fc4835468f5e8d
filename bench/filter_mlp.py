"""Data-dependent sizes benchmark: a filter keeping ~10% of rows, then a heavy MLP.

The same function runs two ways, side by side in one process, on the same data:

* **partitioned** (``px.bucketed(..., partition=True)``, the default): the program is cut at
  ``px.compact(..., length=K)``; segment 0 (score + filter) runs at the rows' bucket, the host
  reads the kept count and segment 1 (the MLP) runs at the smallest ``K`` bucket that holds it.
* **bounded** (``partition=False``): one program; the MLP runs over the full upper-bound buffer
  (all rows, the dropped ones as fill) and the output is sliced to the count afterwards.

Also timed: **exact**, the MLP alone jitted at exactly the kept rows (no filter, no padding) —
the floor the partitioned run can approach. Every timing is warm (after compiling), the median
of ``repeats`` calls, the variants interleaved so that machine noise hits them alike; results are
checked equal before anything is reported.

    python -m bench.filter_mlp                       # 4,096 rows, 10% kept
    python -m bench.filter_mlp --keep 0.05 0.1 0.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import polyexec as px


def make_filter_mlp(rows_var: px.LengthVar, kept_var: px.LengthVar):
    """The benchmarked function: score every row, keep those above ``threshold``, run the MLP
    on the kept rows only."""

    def filter_mlp(mlp, score_w, x, threshold):           # x: (N, width)
        real = px.arange_like(x) < px.valid_length(rows_var)   # padding rows are never kept
        keep = real & (x @ score_w > threshold)
        kept, _ = px.compact(x, keep, length=kept_var)    # (K, width) from here on
        return jax.vmap(mlp)(kept)

    return filter_mlp


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def run(*, rows: int = 4096, keep: float = 0.1, width: int = 256, depth: int = 2,
        repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """Time partitioned vs bounded execution of filter + MLP; return the numbers, flat.

    The MLP is ``eqx.nn.MLP(width -> 4*width -> ... -> width)`` with ``depth`` hidden layers
    (about ``2 * (8 + 16 * (depth - 1)) * width**2`` FLOPs per row). ``keep`` sets the filter's
    threshold to that quantile of the scores, so ``round(keep * rows)`` rows are kept.
    """
    if not 0.0 <= keep <= 1.0:
        raise px.OptionError(f"run: keep: expected a fraction in [0, 1], received {keep}")
    if rows < 1 or width < 1 or depth < 1 or repeats < 1:
        raise px.OptionError(f"run: expected rows, width, depth and repeats >= 1, received "
                             f"rows={rows}, width={width}, depth={depth}, repeats={repeats}")
    N = px.LengthVar("rows", max=rows, buckets=[rows])
    K = px.LengthVar("kept", max=rows)                    # powers of two up to rows
    fn = make_filter_mlp(N, K)
    kw = dict(in_specs=(None, None, px.Spec((N, width), jnp.float32), None),
              out_specs=px.Spec((K, width)))
    partitioned = px.bucketed(fn, name="filter_mlp_partitioned", **kw)
    bounded = px.bucketed(fn, name="filter_mlp_bounded", partition=False, **kw)

    key_mlp, key_score, key_x = jax.random.split(jax.random.PRNGKey(seed), 3)
    mlp = eqx.nn.MLP(width, width, 4 * width, depth, activation=jax.nn.gelu, key=key_mlp)
    score_w = np.asarray(jax.random.normal(key_score, (width,)) / np.sqrt(width), np.float32)
    x = np.asarray(jax.random.normal(key_x, (rows, width)), np.float32)
    scores = x @ score_w
    n_keep = int(round(keep * rows))
    # Keep exactly the n_keep highest scores: the threshold sits between two sorted scores.
    ordered = np.sort(scores)[::-1]
    threshold = np.array(-np.inf if n_keep == rows else
                         (ordered[n_keep] if n_keep == 0 else
                          (ordered[n_keep - 1] + ordered[n_keep]) / 2), np.float32)
    args = (mlp, score_w, x, threshold)

    exact_rows = x[scores > threshold]
    exact = jax.jit(jax.vmap(mlp))

    def call_exact():
        return np.asarray(exact(exact_rows))

    variants = {"partitioned": lambda: partitioned(*args), "bounded": lambda: bounded(*args),
                "exact": call_exact}
    start = time.perf_counter()
    first = {name: call() for name, call in variants.items()}      # compiles
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, call in variants.items():
            t0 = time.perf_counter()
            out = call()
            times[name].append(time.perf_counter() - t0)
            if name != "exact":
                assert out.shape == first[name].shape

    y_part, y_bound, y_exact = first["partitioned"], first["bounded"], first["exact"]
    if not (y_part.shape == y_bound.shape == y_exact.shape == (len(exact_rows), width)):
        raise AssertionError(f"shapes differ: partitioned {y_part.shape}, bounded "
                             f"{y_bound.shape}, exact {y_exact.shape}")
    diff = float(max(np.max(np.abs(y_part - y_bound), initial=0.0),
                     np.max(np.abs(y_part - y_exact), initial=0.0)))
    equal = bool(np.allclose(y_part, y_bound, rtol=1e-4, atol=1e-4)
                 and np.allclose(y_part, y_exact, rtol=1e-4, atol=1e-4))
    if not equal:
        raise AssertionError(f"partitioned and bounded results differ (max abs diff {diff})")

    stats = partitioned.stats
    upstream = sum(b.compiles for k, b in stats.buckets.items() if K.name not in dict(k))
    downstream = {dict(k)[K.name]: b.compiles for k, b in stats.buckets.items()
                  if K.name in dict(k)}
    part_ms, bound_ms, exact_ms = (_median_ms(times[n]) for n in ("partitioned", "bounded",
                                                                   "exact"))
    flops_per_row = 2 * (2 * 4 * width * width + (depth - 1) * 16 * width * width)
    return {
        "device": jax.devices()[0].device_kind,
        "rows": rows, "keep": keep, "kept": int(len(exact_rows)),
        "K_bucket": int(next(iter(downstream))) if downstream else None,
        "width": width, "depth": depth, "repeats": repeats,
        "mlp_gflop_bounded": round(flops_per_row * rows / 1e9, 3),
        "mlp_gflop_partitioned": round(flops_per_row * (next(iter(downstream), 0)) / 1e9, 3),
        "partitioned_ms": round(part_ms, 3),
        "bounded_ms": round(bound_ms, 3),
        "exact_mlp_ms": round(exact_ms, 3),
        "speedup": round(bound_ms / part_ms, 2),
        "partitioned_vs_exact": round(part_ms / exact_ms, 2),
        "compiles_partitioned_upstream": upstream,
        "compiles_partitioned_downstream": sum(downstream.values()),
        "compiles_bounded": bounded.stats.compiles,
        "traces_partitioned": partitioned.traces,
        "traces_bounded": bounded.traces,
        "first_call_s": round(compile_s, 2),
        "max_abs_diff": diff,
        "equal": equal,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.filter_mlp", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--keep", type=float, nargs="+", default=[0.1],
                   help="fraction(s) of rows the filter keeps (one run each)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = p.parse_args(argv)
    results = [run(rows=a.rows, keep=k, width=a.width, depth=a.depth, repeats=a.repeats,
                   seed=a.seed) for k in a.keep]

    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"filter + MLP, partitioned vs bounded ({results[0]['device']}, "
                        f"{a.rows} rows, width {a.width}, depth {a.depth}, median of {a.repeats})",
                  title_justify="left")
    columns = ["keep", "kept", "K_bucket", "partitioned_ms", "bounded_ms", "exact_mlp_ms",
               "speedup", "compiles_partitioned_upstream", "compiles_partitioned_downstream",
               "compiles_bounded", "traces_partitioned", "max_abs_diff"]
    for c in columns:
        table.add_column(c.replace("_", " "), justify="right")
    for r in results:
        table.add_row(*(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in columns))
    Console(width=max(Console().width, 160)).print(table)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
