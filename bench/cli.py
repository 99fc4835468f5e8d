"""``polyexec-bench``: one sequence workload under several padding strategies, side by side.

Each strategy -- and the limit -- runs in a fresh worker process (``polyexec-bench --worker
JOB.json``, the same program) one after another, so every strategy gets its own peak memory,
its own in-memory compile caches, and the CPU to itself; ``polyexec-cached`` is a second
process that finds the persistent compile cache the ``polyexec`` worker filled (in a temporary
folder deleted at the end).

Example (about a minute on 2 cores)::

    polyexec-bench --quick --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

import polyexec as px
from polyexec import training

from . import report
from .devices import worker_xla_flags
from .strategies import (DEFAULT_STRATEGIES, EVENT_PREFIX, Strategy, combine_limits,
                         parse_strategies, strategies_help, worker_main)
from .workloads import DISTS, LAYOUTS, MODELS, MODES, WARMUPS, Config, load_data

# --quick: a workload small enough to run every strategy in under a minute on 2 cores (most
# of that is process start-up and XLA compiles of the train step: ~1-3 s each on CPU).
QUICK = dict(hidden=16, embed=16, heads=2, cap=512, batch_size=8, steps=6, buckets="auto",
             limit_rounds=2, limit_seconds=0.3)
DEFAULTS = dict(hidden=256, embed=64, heads=4, cap=1024, batch_size=32, steps=None, buckets="auto",
                limit_rounds=3, limit_seconds=1.0)


def _buckets_flag(text: str) -> int | str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected auto or an int K >= 1, received {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="polyexec-bench",
        description="Compare padding/bucketing strategies for one sequence workload, each as a "
                    "fraction of the limit (the same step with no padding and no compiles) "
                    "measured in the same run.")
    w = p.add_argument_group("workload")
    w.add_argument("--model", choices=MODELS, default="gru",
                   help="gru/lstm: the examples/rnn CharLM; attention: one causal transformer "
                        "encoder layer (cost quadratic in length); filter-mlp: the "
                        "data-dependent benchmark (bench.filter_mlp); seq2seq: an "
                        "encoder-decoder packed by polyexec against a seqio-style Grain "
                        "peer (bench.seq2seq: --cap, --hidden, --batch-size rows a step, "
                        "--epochs, --num-examples, --seed, --lr, --json)")
    w.add_argument("--mode", choices=MODES, default=None,
                   help="train (default): value_and_grad + optax Adam update; infer: the loss "
                        "only (the default under --quick)")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--corpus", choices=("pydoc",), default=None,
                     help="the pydoc_data.topics sentences as bytes (the default source)")
    src.add_argument("--lengths-file", metavar="FILE",
                     help="one length per line; token ids are random bytes")
    src.add_argument("--dist", choices=DISTS, help="synthetic lengths (random byte ids)")
    w.add_argument("--num-examples", type=int, default=3000, help="examples for --dist")
    w.add_argument("--cap", type=int, help="longest length; longer examples are truncated and "
                                           "counted (default 1024)")
    bs = w.add_mutually_exclusive_group()
    bs.add_argument("--batch-size", type=int,
                    help="examples per batch (the default under --quick and --devices: 32, "
                         "--quick 8)")
    bs.add_argument("--max-tokens", type=int,
                    help="token budget per batch instead: rows x padded length <= this "
                         "(default 32 x --cap: every strategy the tokens of the pack peer's "
                         "32 rows of the cap)")
    w.add_argument("--steps", type=int, help="use only about this many batches' worth of "
                                             "examples per epoch (the same examples for all)")
    w.add_argument("--epochs", type=int, default=2,
                   help="passes over the examples (>= 2): the first is cold, the rest warm")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--hidden", type=int, help="hidden size (attention: model width)")
    w.add_argument("--embed", type=int, help="embedding size (gru/lstm)")
    w.add_argument("--heads", type=int, help="attention heads")
    w.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    w.add_argument("--buckets", type=_buckets_flag,
                   help="polyexec: auto (default: the (length x rows) set with the least predicted "
                        "time, from one compile and step measured in the cold epoch) or K "
                        "(Optimal.fit's K buckets, partial batches padded to full rows)")
    w.add_argument("--limit-rounds", type=int, help="timed chunks per limit shape, the fastest "
                                                    "counts (default 3)")
    w.add_argument("--limit-seconds", type=float, help="time each limit shape about this long "
                                                       "per pass (default 1.0)")
    w.add_argument("--warmup", choices=WARMUPS, default="background",
                   help="polyexec: compile the buckets on a background thread while the first "
                        "batches run in the largest bucket compiled so far (default), or compile "
                        "them all before the first step (blocking)")
    w.add_argument("--layout", choices=LAYOUTS, default="auto",
                   help="polyexec: one sequence per padded row (pad), several per row of the "
                        "longest length (pack), or the one with the least predicted time, "
                        "from the packed step measured in the cold epoch (auto, default)")
    w.add_argument("--devices", type=int, default=None, metavar="N",
                   help="pack and polyexec split every batch's rows over a one-axis Mesh of N "
                        "devices (whole rows a device, parameters replicated: fit's devices=N), "
                        "side by side; --batch-size a multiple of N; the default strategies "
                        "become pack,polyexec,polyexec-cached; on CPU the workers get "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N; the limit stays "
                        "one device's (default 1)")
    w.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="report each strategy's wall time to an epoch whose mean loss is at most "
                        "LOSS (default: the highest last-epoch loss of the strategies run)")
    w.add_argument("--rows", type=int, help="filter-mlp: rows per batch")
    w.add_argument("--keep", type=float, help="filter-mlp: fraction of rows the filter keeps")
    o = p.add_argument_group("run and output")
    o.add_argument("--strategies", default=None,
                   help=f"comma list of {strategies_help()} (default {DEFAULT_STRATEGIES}; a "
                        f"default strategy the workload cannot run is skipped with a note)")
    o.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the strategies N times, in alternating order (the second round "
                        "reversed, ...), each round in fresh processes with fresh compile "
                        "caches: the table shows each strategy's median round (by warm tokens/s) "
                        "and a line gives polyexec's ratio to each strategy in every round "
                        "(default 1)")
    o.add_argument("--quick", action="store_true",
                   help="a tiny workload (inference, hidden 16, cap 512, 6 batches of 8 per "
                        "epoch) that runs every strategy in about a minute; explicit flags win")
    o.add_argument("--json", metavar="OUT", help="write the results as JSON")
    o.add_argument("--plot", metavar="OUT.png", help="write a plot (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    preset = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]
    batch_size, max_tokens = args.batch_size, args.max_tokens
    if batch_size is None and max_tokens is None:
        if args.quick or (args.devices or 1) > 1:
            batch_size = preset["batch_size"]
        else:
            # The same tokens a step for every strategy: the pack peer's rows of the cap. With
            # 32 examples a step instead, packed rows hold 32 examples where the peer's 32 rows
            # hold about 200 (pydoc): the throughputs would compare batch sizes, not layouts.
            max_tokens = preset["batch_size"] * pick("cap")
    source, lengths_file = "pydoc", None
    if args.lengths_file:
        source, lengths_file = "file", args.lengths_file
    elif args.dist:
        source = args.dist
    # --quick measures inference unless told otherwise: an XLA CPU compile of the GRU train step
    # takes 3-8 s on 2 cores against ~0.7 s for the loss alone, and a quick run has ~25 compiles.
    mode = args.mode or ("infer" if args.quick else "train")
    return Config(model=args.model, mode=mode, source=source, lengths_file=lengths_file,
                  num_examples=args.num_examples, cap=pick("cap"), batch_size=batch_size,
                  max_tokens=max_tokens, steps=pick("steps"), epochs=args.epochs,
                  seed=args.seed, hidden=pick("hidden"), embed=pick("embed"),
                  heads=pick("heads"), learning_rate=args.lr, buckets=pick("buckets"),
                  limit_rounds=pick("limit_rounds"), limit_seconds=pick("limit_seconds"),
                  warmup=args.warmup, layout=args.layout, devices=args.devices or 1)


# ------------------------------------------------------------------------------ workers


class WorkerError(RuntimeError):
    pass


def _worker_env(devices: int = 1) -> dict:
    env = dict(os.environ)
    if devices > 1:
        # Read when JAX creates its CPU backend in the worker: N host devices (a GPU or TPU run
        # uses its own; the worker checks it has N).
        env["XLA_FLAGS"] = worker_xla_flags(devices, env.get("XLA_FLAGS", ""))
    # Only the polyexec workers get a persistent compile cache (a fresh one, passed explicitly);
    # a cache inherited from the user's environment would hand other strategies free compiles.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(job: dict, workdir: str, on_event) -> dict:
    """Run one job in a fresh ``python -m bench --worker`` process; return its result."""
    name = job["name"]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    path = os.path.join(workdir, f"job-{safe}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(job, fh)
    err_path = path + ".stderr"
    result = None
    with open(err_path, "w+", encoding="utf-8") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench", "--worker", path],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=_worker_env(job["config"].get("devices", 1)))
        for line in proc.stdout:
            if not line.startswith(EVENT_PREFIX):
                continue
            event = json.loads(line[len(EVENT_PREFIX):])
            if event["event"] == "result":
                result = event["result"]
            else:
                on_event(name, event)
        rc = proc.wait()
        err.seek(0)
        tail = err.read()[-3000:]
    if rc != 0 or result is None:
        raise WorkerError(f"the {name} worker failed (exit status {rc}):\n{tail}")
    return result


def run_all(cfg: Config, strategies: list[Strategy], *, progress: bool = True,
            repeat: int = 1):
    """The limit, then every strategy ``repeat`` times, each in its own process; returns
    (limit passes, rounds: each round's results in ``strategies``' order). Round k runs the
    strategies in reverse order when k is odd (those that ``require`` another still after
    it), so a load that drifts over minutes favours none of them, and with its own compile
    caches and layout choice: each round is cold."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    bar = Progress(*columns, disable=not progress, transient=False)
    label = lambda s, k: s.name if repeat == 1 else f"{s.name} ({k + 1}/{repeat})"
    # Reversed, but a strategy that reads what another leaves behind still runs after it.
    backward = sorted(reversed(range(len(strategies))),
                      key=lambda i: strategies[i].requires is not None)
    order = [(k, i) for k in range(repeat)
             for i in (range(len(strategies)) if k % 2 == 0 else backward)]
    names = ["limit"] + [label(strategies[i], k) for k, i in order] + ["limit (again)"]
    tasks = {n: bar.add_task(n, total=None, start=False) for n in names}

    def on_event(name, event):
        task = tasks[name]
        if event["event"] == "start":
            bar.start_task(task)
            bar.update(task, total=event["total"], completed=0)
        elif event["event"] == "step":
            bar.update(task, completed=event["done"])

    with tempfile.TemporaryDirectory(prefix="polyexec-bench-") as tmp, bar:
        limit_cache = os.path.join(tmp, "xla-cache-limit")
        # The limit worker creates the initial weights and writes them; the others read them.
        state_file = os.path.join(tmp, "initial_state.eqx")
        limit_job = {"strategy": "limit", "config": cfg.to_dict(), "state_file": state_file,
                     "cache_dir": limit_cache}
        passes = [run_worker(dict(limit_job, name="limit"), tmp, on_event)]
        rounds: list[list] = [[None] * len(strategies) for _ in range(repeat)]
        for k, i in order:
            s, own = strategies[i], os.path.join(tmp, f"round-{k}")
            os.makedirs(own, exist_ok=True)
            job = {"strategy": s.name, "name": label(s, k), "config": cfg.to_dict(),
                   "state_file": state_file,
                   "cache_dir": os.path.join(own, s.cache_folder) if s.cache_folder else None,
                   "choice_file": os.path.join(own, "auto-choice.json")}
            rounds[k][i] = run_worker(job, tmp, on_event)
        # A second pass after the strategies (programs from its own compile cache): the load
        # other processes put on the machine drifts over minutes, and the limit is the fastest
        # the step was seen to run.
        passes.append(run_worker(dict(limit_job, name="limit (again)"), tmp, on_event))
    return passes, rounds


def median_round(rounds: list[list[dict]]) -> list[dict]:
    """Each strategy's result from its median round by warm tokens/s (the lower middle of an
    even count): a whole run's numbers, never a mix of rounds."""
    picked = []
    for i in range(len(rounds[0])):
        runs = sorted((r[i] for r in rounds), key=lambda r: r["tokens_per_s_warm"])
        picked.append(runs[(len(runs) - 1) // 2])
    return picked


def round_lines(rounds: list[list[dict]]) -> list[str]:
    """polyexec's ratio to every other strategy in each round, side by side, and the median."""
    lines = []
    names = [r["strategy"] for r in rounds[0]]
    if "polyexec" not in names or len(rounds) < 2:
        return lines
    p = names.index("polyexec")
    for i, name in enumerate(names):
        if i == p:
            continue
        parts = []
        for kind in ("warm", "cold"):
            key = f"tokens_per_s_{kind}"
            ratios = [r[p][key] / r[i][key] for r in rounds]
            parts.append(f"{kind} {', '.join(f'{x:.2f}x' for x in ratios)} (median "
                         f"{float(np.median(ratios)):.2f}x)")
        lines.append(f"polyexec / {name}, each round side by side: {'; '.join(parts)}")
    return lines


# --------------------------------------------------------------------------- seq2seq


def run_seq2seq(args: argparse.Namespace) -> int:
    """``--model seq2seq``: `bench.seq2seq.run` with the workload flags that apply to it."""
    from . import seq2seq
    kwargs = {k: v for k, v in (("cap", args.cap), ("hidden", args.hidden),
                                ("rows", args.batch_size), ("epochs", args.epochs),
                                ("num_examples", args.num_examples),
                                ("seed", args.seed), ("lr", args.lr)) if v is not None}
    result = seq2seq.run(**kwargs)
    seq2seq.print_result(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"workload": {"model": "seq2seq", **result["workload"]},
                       "result": result["strategies"]}, fh, indent=2)
    return 0


# --------------------------------------------------------------------------- filter-mlp


def run_filter_mlp(args: argparse.Namespace) -> int:
    from rich.table import Table

    if importlib.util.find_spec("bench.filter_mlp") is None:
        raise SystemExit("--model filter-mlp: bench/filter_mlp.py (the data-dependent "
                         "benchmark) is not in this installation")
    from . import filter_mlp
    accepted = inspect.signature(filter_mlp.run).parameters
    kwargs = {k: v for k, v in (("rows", args.rows), ("keep", args.keep), ("seed", args.seed))
              if v is not None and k in accepted}
    result = filter_mlp.run(**kwargs)
    console = _console()
    table = Table(title=f"filter-mlp (bench.filter_mlp.run({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}))",
                  title_justify="left")
    inner = [v for v in result.values() if isinstance(v, dict)]
    if inner and len(inner) == len(result):
        cols = list(dict.fromkeys(k for d in inner for k in d))
        table.add_column("")
        for c in cols:
            table.add_column(str(c), justify="right")
        for name, d in result.items():
            table.add_row(str(name), *(_fmt(d.get(c, "")) for c in cols))
    else:
        table.add_column("measure")
        table.add_column("value", justify="right")
        for k, v in result.items():
            table.add_row(str(k), _fmt(v))
    console.print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"workload": {"model": "filter-mlp", **kwargs}, "result": result}, fh,
                      indent=2, default=str)
    return 0


def _console():
    from rich.console import Console
    console = Console()
    # Piped output (tests, logs) gets rich's 80 columns by default, too narrow for the table.
    return console if console.is_terminal else Console(width=180)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


# -------------------------------------------------------------------------------- main


def workload_dict(cfg: Config, data, passes: list[dict], rates: list[float],
                  results: list[dict]) -> dict:
    lengths = data.lengths
    grouped = [r["strategy"] for r in results if r["batching"] == "grouped"]
    packed = [r["strategy"] for r in results if r["batching"] == "packed"]
    polyexec_buckets = next((r["buckets"] for r in results if r["strategy"] == "polyexec"), None)
    return {
        "model": cfg.model, "mode": cfg.mode, "source": data.description,
        "examples": int(lengths.size), "examples_in_source": data.n_source,
        "cap": cfg.cap, "truncated_by_cap": data.n_capped,
        "real_tokens_per_epoch": data.real_tokens,
        "length_median": float(np.median(lengths)),
        "length_p99": float(np.percentile(lengths, 99)), "length_max": int(lengths.max()),
        "batch_size": cfg.batch_size, "max_tokens": cfg.max_tokens, "epochs": cfg.epochs,
        "steps": cfg.steps, "seed": cfg.seed, "hidden": cfg.hidden, "embed": cfg.embed,
        "heads": cfg.heads if cfg.model == "attention" else None,
        "learning_rate": cfg.learning_rate, "polyexec_buckets_option": cfg.buckets,
        "polyexec_buckets": polyexec_buckets,
        "batching": {r["strategy"]: r["batching"] for r in results},
        "note": ("every strategy runs every example once per epoch; "
                 + (f"{', '.join(grouped)} visit them in length-grouped batches "
                    "(buckets.batch_plan), the others in one shared random order"
                    if grouped else "all strategies share one random order")
                 + (f"; {', '.join(packed)} pack examples first-fit into rows, several a row, "
                    f"so they take fewer steps (pack: the shared order into rows of the cap, by "
                    f"Grain; polyexec: buckets.packed_batch_plan); loss: each epoch's summed "
                    f"nats / predictions, equal data for all"
                    if packed else "")
                 + ("" if cfg.max_tokens is None else
                    f"; under --max-tokens random batches are cut per strategy, so that rows x "
                    f"its padded length stays within {cfg.max_tokens}")),
        "limit": {"method": "per length group (Optimal.fit buckets), batches of rows all of "
                            "the group's mean length (every row real) at --batch-size rows "
                            "and at as many rows as a batch of the cap holds tokens, plain "
                            "jax.jit compiled before timing, fastest chunk of calls, the "
                            "faster shape per group; two passes (before and after the "
                            "strategies), fastest per group; limit = total real tokens / "
                            "sum(group tokens / group rate)",
                  "group_tokens_per_s": rates,
                  "passes": [{"limit_tokens_per_s": p["limit_tokens_per_s"],
                              "groups": p["groups"]} for p in passes],
                  "jax": passes[0].get("jax"), "device": passes[0].get("device")},
        "per_strategy": {r["strategy"]: {k: r[k] for k in ("bucket_count", "buckets", "partial_rows", "auto",
                                                           "choosing_seconds", "plan_seconds",
                                                           "cache_hits", "steps", "warmup",
                                                           "upgraded_batches",
                                                           "epoch_seconds", "final_loss",
                                                           "epoch_loss", "distinct_shapes")}
                         for r in results},
    }


def clamp_batch_size(cfg: Config, data) -> tuple[Config, str | None]:
    """``cfg`` with a batch size no larger than the examples, and a note when it was larger:
    rows beyond the examples are only padding, yet every strategy and the limit would allocate
    and compile for them. The examples stay the same (``--steps`` keeps them all either way).

    >>> cfg = Config(source="uniform", num_examples=5, cap=8, batch_size=100)
    >>> cfg, note = clamp_batch_size(cfg, load_data(cfg))
    >>> cfg.batch_size, note
    (5, 'note: --batch-size 100 is more than the 5 examples; using --batch-size 5')
    """
    n = int(data.lengths.size)
    if cfg.batch_size is None or cfg.batch_size <= n:
        return cfg, None
    return (dataclasses.replace(cfg, batch_size=n),
            f"note: --batch-size {cfg.batch_size} is more than the {n} examples; using "
            f"--batch-size {n}")


def check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and ``--plot`` checked (folder exists, test write, not a folder) and
    matplotlib found before any worker starts, not after the whole run."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            training.check_output_file(path, flag)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise px.OptionError("--plot: expected matplotlib to be installed (pip install "
                             "'polyexec[plot]'), received a --plot path without it")


MULTI_DEVICE_STRATEGIES = "pack,polyexec,polyexec-cached"


def check_devices(args: argparse.Namespace) -> None:
    """``--devices N``: an int >= 1; over several devices whole rows a device (``--batch-size``
    a multiple of N, and no ``--max-tokens``: its row counts are the strategies' own), and
    the sequence workloads only."""
    n = args.devices
    if n is None:
        return
    if n < 1:
        raise px.OptionError(f"--devices: expected an int >= 1, received {n}")
    if n == 1:
        return
    if args.model in ("filter-mlp", "seq2seq"):
        raise px.OptionError(f"--devices {n}: expected --model gru / lstm / attention (the "
                             f"{args.model} benchmark runs on one device), received --model "
                             f"{args.model}")
    if args.max_tokens is not None:
        raise px.OptionError(f"--devices {n}: expected --batch-size (a multiple of {n}: every "
                             f"device holds whole rows), received --max-tokens "
                             f"{args.max_tokens}")
    rows = args.batch_size if args.batch_size is not None else (
        QUICK if args.quick else DEFAULTS)["batch_size"]
    if rows % n:
        raise px.OptionError(f"--devices {n}: expected --batch-size a multiple of {n} (every "
                             f"device holds whole rows), received --batch-size {rows}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    # A bad flag is a one-line usage error (exit status 2), like argparse's own, before any
    # worker starts: bad values raise OptionError, a missing --lengths-file an OSError.
    notes = []
    try:
        check_outputs(args)
        if args.target_loss is not None and not (math.isfinite(args.target_loss)
                                                 and args.target_loss > 0):
            raise px.OptionError(f"--target-loss: expected a finite number > 0, received "
                                 f"{args.target_loss}")
        if args.repeat < 1:
            raise px.OptionError(f"--repeat: expected an int >= 1, received {args.repeat}")
        check_devices(args)
        if args.model == "filter-mlp":
            # Its own comparison (bench.filter_mlp): a strategy asked for by name is refused.
            for s in parse_strategies(args.strategies) if args.strategies is not None else []:
                s.check_model(args.model)
            return run_filter_mlp(args)
        if args.model == "seq2seq":
            for s in parse_strategies(args.strategies) if args.strategies is not None else []:
                s.check_model(args.model)
            return run_seq2seq(args)
        cfg = config_from_args(args)
        strategies = parse_strategies(args.strategies or (
            DEFAULT_STRATEGIES if cfg.devices == 1 else MULTI_DEVICE_STRATEGIES))
        data = load_data(cfg)
        cfg, note = clamp_batch_size(cfg, data)
        notes += [note] if note else []
        runnable = []
        for s in strategies:     # bad fixed sizes, a model or mode a strategy lacks fail here
            try:
                s.check(cfg, data)
            except px.OptionError as e:
                if args.strategies is not None:
                    raise              # asked for by name: an error
                notes.append(f"note: {s.name} skipped: {e}")
                continue
            runnable.append(s)
        strategies = [s for s in runnable if s.requires is None
                      or s.requires in {r.name for r in runnable}]
    except (px.OptionError, OSError) as e:
        parser.error(str(e))

    console = _console()
    for note in notes:
        console.print(note)
    console.print(f"[bold]{cfg.model} {cfg.mode}[/]: {data.description}; cap {cfg.cap} "
                  f"truncated {data.n_capped} example(s); {data.real_tokens:,} real tokens "
                  f"per epoch, {cfg.epochs} epochs")
    if cfg.devices > 1:
        console.print(f"devices: {cfg.devices} -- {', '.join(s.name for s in strategies)} split "
                      f"each batch's {cfg.batch_size} rows over a {cfg.devices}-device Mesh "
                      f"(whole rows a device, parameters replicated); the limit is one "
                      f"device's")
    try:
        passes, rounds = run_all(cfg, strategies, progress=not args.no_progress,
                                 repeat=args.repeat)
    except WorkerError as e:
        raise SystemExit(f"polyexec-bench: {e}") from None
    results = median_round(rounds)
    limit, rates = combine_limits([p["groups"] for p in passes], data.real_tokens)
    workload = workload_dict(cfg, data, passes, rates, results)
    if cfg.devices > 1:      # absent with one device: the default output is unchanged
        workload["devices"] = {"count": cfg.devices,
                               # each strategy's state after its last step, on these
                               "state_on_devices": {r["strategy"]: r["devices"]
                                                    for r in results},
                               "mesh": "one axis 'batch': rows split, parameters replicated",
                               "limit": "one device"}
    if args.repeat > 1:
        workload["rounds"] = [{r["strategy"]: {k: r[k] for k in ("tokens_per_s_cold",
                                                                  "tokens_per_s_warm")}
                               for r in rnd} for rnd in rounds]
    to_loss, workload["time_to_loss"] = report.time_to_loss_line(workload["per_strategy"],
                                                                 args.target_loss)
    doc = report.json_document(workload, limit, results)
    extras = {r["strategy"]: r for r in results}
    console.print(report.results_table(doc, extras))
    console.print(doc["workload"]["note"])
    if args.repeat > 1:
        console.print(f"{args.repeat} rounds: each strategy's row is its median round by warm "
                      f"tokens/s, so ratios between rows may compare different rounds; the "
                      f"last lines compare the strategies within each round")
    predicted = [line for line in map(report.predicted_run_line, results) if line]
    for line in report.summary_lines(doc) + [to_loss] + predicted + round_lines(rounds):
        console.print(line)
    chosen = next((r for r in results if r.get("auto") and not r["auto"].get("reused")), None)
    if chosen is not None:
        auto, cost = chosen["auto"], chosen["auto"]["cost"]
        picked = (f"packed rows ({', '.join(f'{r} rows of {n}' for n, r in auto['pack_rows'].items())})"
                  if auto["layout"] == "pack" else
                  f"T={auto['sizes']}" + (f" (partial batches at their own rows for "
                                           f"T={auto['partial_rows']})" if auto["partial_rows"]
                                           else ""))
        measured = ("nothing measured" if cost is None else
                    f"compile {cost['compile_seconds']:.2f} s a shape (counted at 1/2 when they "
                    f"overlap training in the background), {cost['seconds_per_cell'] * 1e6:.2f} "
                    f"us per cell")
        console.print(f"--buckets auto --layout {cfg.layout} ({chosen['strategy']}, "
                      f"{chosen['choosing_seconds']:.1f} s of its cold epoch): {measured}; chose "
                      f"{picked}: {auto['reason']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
    if args.plot:
        padded = data.padded_lengths
        import buckets
        distinct = np.unique(padded).size
        curve = [(k, buckets.Optimal.fit(padded, max_buckets=k).padding_efficiency(padded))
                 for k in range(1, min(32, distinct) + 1)]
        g = buckets.Geometric(2, cfg.cap)
        report.plot(doc, extras, curve, (len(g.sizes), g.padding_efficiency(padded)), args.plot)
        console.print(f"plot written to {args.plot}")
    return 0
