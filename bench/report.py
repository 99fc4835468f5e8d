"""Presenting a benchmark: the JSON document and its schema, the rich table, the plot.

>>> doc = {"workload": {"model": "gru"}, "limit_tokens_per_s": 100.0, "results": [
...     {"strategy": "pad-max", "compiles": 1, "traces": 1, "compile_s": 0.5,
...      "padding_efficiency": 0.2, "tokens_per_s_cold": 10.0, "tokens_per_s_warm": 20.0,
...      "fraction_of_limit_cold": 0.1, "fraction_of_limit_warm": 0.2, "peak_rss_mb": 300.0}]}
>>> validate(doc) is doc
True
"""

from __future__ import annotations

import math
from typing import Any

import polyexec as px

from .strategies import parse_strategy

RESULT_KEYS: dict[str, type | tuple[type, ...]] = {
    "strategy": str,
    "compiles": int,
    "traces": int,
    "compile_s": (int, float),
    "padding_efficiency": (int, float),
    "tokens_per_s_cold": (int, float),
    "tokens_per_s_warm": (int, float),
    "fraction_of_limit_cold": (int, float),
    "fraction_of_limit_warm": (int, float),
    "peak_rss_mb": (int, float),
}
TOP_KEYS = ("workload", "limit_tokens_per_s", "results")


class SchemaError(px.PolyexecError, ValueError):
    """The benchmark JSON does not have the documented shape; the message names the path."""


def validate(doc: Any) -> Any:
    """Check ``doc`` against the ``--json`` schema (exact keys, types, ranges); return it.

    ``{"workload": {...}, "limit_tokens_per_s": x > 0, "results": [{RESULT_KEYS}, ...]}``:
    counts are ints >= 0, rates and seconds finite and >= 0, padding efficiency in (0, 1].
    """
    def fail(path: str, msg: str):
        raise SchemaError(f"{path}: {msg}")

    if not isinstance(doc, dict):
        fail("$", f"expected an object, received {type(doc).__name__}")
    if set(doc) != set(TOP_KEYS):
        fail("$", f"expected exactly the keys {list(TOP_KEYS)}, received {sorted(doc)}")
    if not isinstance(doc["workload"], dict):
        fail("$.workload", "expected an object")
    limit = doc["limit_tokens_per_s"]
    if not _is_number(limit) or not limit > 0:
        fail("$.limit_tokens_per_s", f"expected a finite number > 0, received {limit!r}")
    if not isinstance(doc["results"], list) or not doc["results"]:
        fail("$.results", "expected a non-empty list")
    seen = set()
    for i, row in enumerate(doc["results"]):
        path = f"$.results[{i}]"
        if not isinstance(row, dict):
            fail(path, "expected an object")
        if set(row) != set(RESULT_KEYS):
            missing, extra = set(RESULT_KEYS) - set(row), set(row) - set(RESULT_KEYS)
            fail(path, f"keys differ from the schema: missing {sorted(missing)}, "
                       f"unexpected {sorted(extra)}")
        for key, kind in RESULT_KEYS.items():
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, kind):
                fail(f"{path}.{key}", f"expected {_kind_name(kind)}, received {value!r}")
            if kind is not str and (not _is_number(value) or value < 0):
                fail(f"{path}.{key}", f"expected a finite number >= 0, received {value!r}")
        if not 0 < row["padding_efficiency"] <= 1:
            fail(f"{path}.padding_efficiency", f"expected a value in (0, 1], received "
                                               f"{row['padding_efficiency']!r}")
        for which in ("cold", "warm"):
            expected = row[f"tokens_per_s_{which}"] / limit
            if not math.isclose(row[f"fraction_of_limit_{which}"], expected, rel_tol=1e-6):
                fail(f"{path}.fraction_of_limit_{which}",
                     f"expected tokens_per_s_{which} / limit_tokens_per_s = {expected!r}, received "
                     f"{row[f'fraction_of_limit_{which}']!r}")
        if row["strategy"] in seen:
            fail(f"{path}.strategy", f"{row['strategy']!r} appears twice")
        seen.add(row["strategy"])
    return doc


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def json_document(workload: dict, limit: float, results: list[dict]) -> dict:
    """The ``--json`` document: exactly the schema's keys, with fractions of the limit."""
    rows = []
    for r in results:
        row = {k: r[k] for k in RESULT_KEYS if not k.startswith("fraction_")}
        row["fraction_of_limit_cold"] = r["tokens_per_s_cold"] / limit
        row["fraction_of_limit_warm"] = r["tokens_per_s_warm"] / limit
        rows.append({k: row[k] for k in RESULT_KEYS})
    return validate({"workload": workload, "limit_tokens_per_s": limit, "results": rows})


# ------------------------------------------------------------------------ time to a loss


def time_to_loss(epoch_seconds: list[float], epoch_loss: list[float],
                 target: float) -> tuple[float, int] | None:
    """``(wall seconds, epoch)`` until the end of the first epoch whose mean loss is at most
    ``target`` (epochs count from 1, the cold one's set-up and compiles included), or None
    when no epoch reaches it. A strategy's steps an epoch change with its batching (packed
    rows take fewer, fuller ones), so tokens per second alone can mislead: this is what the
    throughput buys.

    >>> time_to_loss([10.0, 6.0, 6.0], [4.1, 3.2, 2.9], 3.2)
    (16.0, 2)
    >>> time_to_loss([10.0, 6.0], [4.1, 3.5], 3.2) is None
    True
    """
    elapsed = 0.0
    for epoch, (seconds, loss) in enumerate(zip(epoch_seconds, epoch_loss), 1):
        elapsed += seconds
        if loss <= target:
            return elapsed, epoch
    return None


def loss_target(per_strategy: dict[str, dict], given: float | None) -> tuple[float, str]:
    """``(target, what it is)``: ``--target-loss`` when given, else the highest last-epoch
    mean loss of the strategies run -- the loss each of them reaches by its last epoch, so the
    times say who reaches it first.

    >>> loss_target({"pack": {"epoch_loss": [4.9, 4.8]}, "polyexec": {"epoch_loss": [3.4, 3.0]}},
    ...             None)
    (4.8, "the highest last-epoch loss (pack's)")
    """
    if given is not None:
        return given, "--target-loss"
    name = max(per_strategy, key=lambda n: per_strategy[n]["epoch_loss"][-1])
    return per_strategy[name]["epoch_loss"][-1], f"the highest last-epoch loss ({name}'s)"


def time_to_loss_line(per_strategy: dict[str, dict], given: float | None) -> tuple[str, dict]:
    """The summary sentence and the JSON record (`workload["time_to_loss"]`) of every
    strategy's time to the target loss (`loss_target`), at the end of an epoch."""
    target, basis = loss_target(per_strategy, given)
    seconds = {n: time_to_loss(x["epoch_seconds"], x["epoch_loss"], target)
               for n, x in per_strategy.items()}
    parts = [f"{n} {t[0]:.1f} s (epoch {t[1]})" if t else f"{n} not reached"
             for n, t in seconds.items()]
    line = (f"time to mean epoch loss <= {target:.4f} ({basis}), at the end of an epoch: "
            + ", ".join(parts))
    record = {"target": target, "basis": basis,
              "seconds": {n: t[0] if t else None for n, t in seconds.items()},
              "epoch": {n: t[1] if t else None for n, t in seconds.items()}}
    return line, record


def predicted_run_line(row: dict) -> str | None:
    """``--buckets auto``'s prediction of a strategy's run against its clock, or None without
    one: the seconds it spent choosing (compiles and timed steps, measured) plus its
    prediction for every other step and compile, against the epochs' wall seconds.

    >>> print(predicted_run_line({"strategy": "polyexec", "choosing_seconds": 6.0,
    ...     "epoch_seconds": [12.0, 6.0], "auto": {"timed_steps": 4, "predicted":
    ...     {"seconds": 15.0, "steps": 60}}}))
    polyexec: predicted 20.0 s for the run (6.0 s choosing, measured, + 14.0 s for the other 56 steps and their compiles), measured 18.0 s: 1.11x
    """
    auto = row.get("auto")
    if not auto or not auto.get("predicted") or auto.get("reused"):
        return None
    predicted, timed = auto["predicted"], auto.get("timed_steps", 0)
    rest = predicted["seconds"] * (1 - timed / max(predicted["steps"], 1))
    total, measured = row["choosing_seconds"] + rest, sum(row["epoch_seconds"])
    return (f"{row['strategy']}: predicted {total:.1f} s for the run ({row['choosing_seconds']:.1f} "
            f"s choosing, measured, + {rest:.1f} s for the other {predicted['steps'] - timed} "
            f"steps and their compiles), measured {measured:.1f} s: {total / measured:.2f}x")


# ----------------------------------------------------------------------------- the table


def results_table(doc: dict, extras: dict[str, dict]):
    """A rich Table of the results; ``extras[strategy]`` adds batching, optimiser steps,
    buckets, cache hits, and the loss: the last epoch's summed nats / predictions (every
    strategy saw the same examples, however it batched them); the workload's
    ``time_to_loss`` (`time_to_loss_line`), the wall seconds to the target loss."""
    from rich.table import Table

    limit = doc["limit_tokens_per_s"]
    w = doc["workload"]
    table = Table(title=f"{w.get('model')} {w.get('mode')} step, {w.get('examples')} examples, "
                        f"{w.get('epochs')} epochs, cap {w.get('cap')} -- limit "
                        f"{limit:,.0f} real tokens/s",
                  title_justify="left")
    for col, justify in (("strategy", "left"), ("batches", "left"), ("steps", "right"),
                         ("buckets", "right"),
                         ("compiles", "right"), ("cache hits", "right"), ("traces", "right"),
                         ("compile s", "right"),
                         ("pad eff", "right"), ("tok/s cold", "right"), ("tok/s warm", "right"),
                         ("x limit cold", "right"), ("x limit warm", "right"),
                         ("loss", "right"), ("s to loss", "right"), ("peak RSS MB", "right")):
        table.add_column(col, justify=justify, no_wrap=col == "strategy")
    to_loss = w.get("time_to_loss", {}).get("seconds", {})
    for r in doc["results"]:
        x = extras.get(r["strategy"], {})
        epoch_loss = x.get("epoch_loss")
        seconds = to_loss.get(r["strategy"])
        table.add_row(r["strategy"], x.get("batching", ""), str(x.get("steps", "")),
                      str(x.get("bucket_count", "")), str(r["compiles"]),
                      str(x.get("cache_hits", "")), str(r["traces"]),
                      f"{r['compile_s']:.1f}", f"{r['padding_efficiency']:.3f}",
                      f"{r['tokens_per_s_cold']:,.0f}", f"{r['tokens_per_s_warm']:,.0f}",
                      f"{r['fraction_of_limit_cold']:.2f}", f"{r['fraction_of_limit_warm']:.2f}",
                      f"{epoch_loss[-1]:.4f}" if epoch_loss else "",
                      "" if r["strategy"] not in to_loss else
                      "not reached" if seconds is None else f"{seconds:.1f}",
                      f"{r['peak_rss_mb']:,.0f}")
    return table


def summary_lines(doc: dict) -> list[str]:
    """polyexec against the goals (>= 0.8 of the limit warm, >= 0.5 cold, and each peer's
    ``goal``: >= 4x pad-max, >= 3x exact), as plain sentences with the measured numbers; each
    other strategy adds its own sentence (`Strategy.summary_line`)."""
    by = {r["strategy"]: r for r in doc["results"]}
    p = by.get("polyexec")
    if p is None:
        return []
    lines = [f"polyexec: {p['fraction_of_limit_warm']:.2f} of the limit warm (goal 0.8), "
             f"{p['fraction_of_limit_cold']:.2f} cold (goal 0.5)"]
    extra = doc["workload"].get("per_strategy", {}).get("polyexec", {})
    compiles = compile_line(p, extra, doc["workload"].get("limit", {}).get("passes", []))
    if compiles:
        lines.append(compiles)
    if extra.get("warmup") == "background":
        lines.append(f"polyexec warmup in the background: {extra.get('upgraded_batches', 0)} "
                     f"first-epoch batch(es) ran padded to a compiled bucket at most 2x their own while "
                     f"theirs compiled")
    for row in doc["results"]:         # each strategy says how polyexec compares with it
        if row is p:
            continue
        line = parse_strategy(row["strategy"]).summary_line(
            row, p, doc["workload"].get("per_strategy", {}).get(row["strategy"], {}))
        if line:
            lines.append(line)
    return lines


def compile_line(row: dict, extra: dict, limit_passes: list[dict]) -> str | None:
    """polyexec's compile seconds a shape against plain ``jax.jit``'s compile of the same step
    (trace, lower, compile) at the limit's shapes in its first pass (the second loads them from
    its cache), and, apart, the plan polyexec makes once before any compile (`Plan.seconds`).
    None when polyexec compiled nothing (a persistent-cache run) or the limit has no timings.

    The two are timed at different shapes, in different worker processes, at different times
    on a shared machine: the line is a rough guide. ``python -m bench.core_timing`` times
    both side by side at the same shapes (the ratio to hold at <= 1.2x).

    >>> passes = [{"groups": [{"compile_s": 1.0}, {"compile_s": 1.5}]}]
    >>> print(compile_line({"compiles": 2, "compile_s": 3.0}, {"plan_seconds": {"trace": 0.5,
    ...     "rewrite": 0.25}}, passes))
    compiles: polyexec 1.50 s a shape (2 shapes) against jax.jit 1.25 s a shape (the limit's 2 shapes, not polyexec's; at the same shapes: python -m bench.core_timing): 1.20x; polyexec's plan, once before them: trace 0.50 s, rewrite 0.25 s
    """
    jit = [shape["compile_s"] for g in (limit_passes[0]["groups"] if limit_passes else [])
           for shape in g.get("shapes", [g]) if "compile_s" in shape]
    if not row["compiles"] or not jit:
        return None
    theirs = sum(jit) / len(jit)
    plan = extra.get("plan_seconds") or {}
    stages = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in plan.items())
    ours = row["compile_s"] / row["compiles"]
    shapes = f"{row['compiles']} shape" + ("s" if row["compiles"] > 1 else "")
    if extra.get("warmup") == "background":     # wall seconds, sharing the cores with steps
        shapes += ", most compiled in the background beside training"
    return (f"compiles: polyexec {ours:.2f} s a shape ({shapes}) against jax.jit "
            f"{theirs:.2f} s a shape (the limit's {len(jit)} shapes, not polyexec's; at the same "
            f"shapes: python -m bench.core_timing): {ours / theirs:.2f}x"
            + (f"; polyexec's plan, once before them: {stages}" if stages else ""))


# ------------------------------------------------------------------------------ the plot


def plot(doc: dict, extras: dict[str, dict], efficiency_curve: list[tuple[int, float]],
         pow2_point: tuple[int, float] | None, path: str) -> None:
    """Two panels: tokens/s per strategy (cold and warm) against the limit; padding efficiency
    against bucket count (the Optimal.fit curve, power-of-two buckets, each strategy as run)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'polyexec[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    names = [r["strategy"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = range(len(results))
    ax1.bar([x - 0.2 for x in xs], [r["tokens_per_s_cold"] for r in results], 0.4, label="cold")
    ax1.bar([x + 0.2 for x in xs], [r["tokens_per_s_warm"] for r in results], 0.4, label="warm")
    ax1.axhline(doc["limit_tokens_per_s"], color="black", linestyle="--",
                label=f"limit {doc['limit_tokens_per_s']:,.0f}")
    ax1.set_xticks(list(xs), names, rotation=20, ha="right")
    ax1.set_ylabel("real tokens / s")
    ax1.set_title("throughput against the limit (padding efficiency 1.0, no compiles)")
    ax1.legend()

    if efficiency_curve:
        ks, effs = zip(*efficiency_curve)
        ax2.plot(ks, effs, marker=".", label="Optimal.fit (per example)")
    if pow2_point:
        ax2.scatter([pow2_point[0]], [pow2_point[1]], marker="s", color="gray",
                    label="powers of two (per example)")
    labelled: dict[tuple, list[str]] = {}
    for r in results:
        k = extras.get(r["strategy"], {}).get("bucket_count")
        if k:
            point = (k, round(r["padding_efficiency"], 3))
            labelled.setdefault(point, []).append(r["strategy"])
    placed: list[tuple[int, float]] = []
    for (k, eff), strategies in labelled.items():   # one label per point: cached == polyexec
        ax2.scatter([k], [eff], marker="o", zorder=3)
        # Nearby points at the same bucket count (polyexec and polyexec-cached): stack labels.
        shift = 12 * sum(1 for pk, pe in placed if pk == k and abs(pe - eff) < 0.04)
        placed.append((k, eff))
        ax2.annotate(" = ".join(strategies), (k, eff), fontsize=8, xytext=(4, -10 + shift),
                     textcoords="offset points")
    ax2.set_xscale("log")
    ax2.set_xlabel("bucket count (exact: distinct shapes)")
    ax2.set_ylabel("padding efficiency (real / padded tokens)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("padding efficiency vs bucket count (dots: as run, with batch grouping)")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
