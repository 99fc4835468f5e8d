"""polyexec-bench: option parsing, schedules, the JSON schema, and --quick end to end."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import pathlib

import numpy as np

import buckets
import pytest
from conftest import run_once

import polyexec as px
from bench import report
from bench.cli import config_from_args, build_parser, main
from bench import strategies
from bench.strategies import (REGISTRY, BackgroundWarmup, Files, Strategy, combine_limits,
                              limit_shapes, padded_batch, parse_strategies, parse_strategy,
                              register, run_strategy, strategies_help)
from bench.workloads import Config, load_data, read_lengths_file

ALL = "pad-max,exact,pow2,fixed:64,160,512,polyexec,polyexec-nomask,polyexec-cached"
RANDOM = ("pad-max", "exact", "pow2", "fixed:64,160,512")
HAS_GRAIN = importlib.util.find_spec("grain") is not None
# The --quick runs below are module fixtures shared by the tests that read them, each run
# once per test run (the xdist workers share it: conftest.run_once).
# Timing is never asserted: the limit is timed as briefly as the CLI allows.
BRIEF_LIMIT = ["--limit-rounds", "1", "--limit-seconds", "0.05"]


def _run_quick(argv):
    """``main(argv)`` with its printed output captured: (the validated JSON, the printed text
    with rich's line wrapping undone)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*argv, "--no-progress"]) == 0
    out = argv[argv.index("--json") + 1]
    with open(out, encoding="utf-8") as fh:
        doc = report.validate(json.load(fh))
    return doc, " ".join(printed.getvalue().split())


# ----------------------------------------------------------------------------- no JAX needed


def test_parse_strategies_fixed_sizes_and_order():
    got = parse_strategies("polyexec-cached,fixed:64,16,1024,exact,polyexec")
    assert [s.name for s in got] == ["fixed:16,64,1024", "exact", "polyexec", "polyexec-cached"]
    assert got[0].sizes == (16, 64, 1024)


@pytest.mark.parametrize("text, message", [
    ("pad-max,bogus", "expected one of pad-max, exact, pow2, .*, polyexec-nomask, pack, polyexec-pack; "
                      "received unknown strategy 'bogus'"),
    ("fixed:", "fixed sizes: expected integers .*, received ''"),
    ("pad-max,pad-max", "expected each strategy once, received pad-max given twice"),
    ("polyexec-cached", "list polyexec too"),
    ("fixed:1,8", "fixed sizes: expected sizes >= 2 .*, received fixed:1,8"),
    ("pad-max,,exact", "received an empty entry"),
])
def test_parse_strategies_rejects(text, message):
    with pytest.raises(px.OptionError, match=message):
        parse_strategies(text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="rnn"), "Config: model: expected one of 'gru', 'lstm', .*, received 'rnn'"),
    (dict(batch_size=None), "expected exactly one of batch_size / max_tokens"),
    (dict(epochs=1), "Config: epochs: expected an int >= 2, received 1"),
    (dict(hidden=2.0), "Config: hidden: expected an int >= 1, received 2.0"),
    (dict(learning_rate=0.0), "Config: learning_rate: expected a finite number > 0, received 0.0"),
    (dict(learning_rate=math.inf), "Config: learning_rate: expected a finite number > 0, received inf"),
    (dict(batch_size=None, max_tokens=100),
     "Config: max_tokens: expected at least cap=1024 .*, received 100"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(px.OptionError, match=message):
        Config(**kwargs)


def test_lengths_file_errors_name_the_line(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# comment\n12\n\n7\n")
    assert read_lengths_file(str(path)).tolist() == [12, 7]
    path.write_text("12\nabc\n")
    with pytest.raises(px.OptionError, match="line 2: expected an integer length, received 'abc'"):
        read_lengths_file(str(path))
    path.write_text("3\n0\n")
    with pytest.raises(px.OptionError, match="line 2: expected a length >= 1, received 0"):
        read_lengths_file(str(path))


def test_lengths_file_data_is_capped_and_counted(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n300\n40\n")
    data = load_data(Config(source="file", lengths_file=str(path), cap=64, batch_size=2))
    assert data.lengths.tolist() == [5, 64, 40]
    assert data.n_capped == 1
    assert (data.tokens[0, :5] > 0).all() and (data.tokens[0, 5:] == 0).all()


def test_steps_keeps_the_same_subset_for_everyone():
    a = load_data(Config(cap=256, batch_size=8, steps=3, seed=4))
    b = load_data(Config(cap=256, batch_size=8, steps=3, seed=4))
    assert a.lengths.size == 24 and np.array_equal(a.tokens, b.tokens)
    full = load_data(Config(cap=256, batch_size=8))
    assert a.n_source == full.lengths.size


@pytest.mark.parametrize("batching", [dict(batch_size=7), dict(batch_size=None, max_tokens=512)])
@pytest.mark.parametrize("kind", ["pad-max", "exact", "pow2", "polyexec"])
def test_every_example_once_per_epoch(kind, batching):
    cfg = Config(source="lognormal", num_examples=200, cap=256, seed=3, **batching)
    data = load_data(cfg)
    strategy = parse_strategy(kind)
    policy = strategy.t_policy(cfg, data)
    if kind == "polyexec":   # --buckets auto: chosen in the worker from a measured cost
        assert policy is None
        policy = buckets.Auto.fit(data.padded_lengths, buckets.CostModel(0.5, 1e-5), epochs=2,
                                  batch_size=cfg.batch_size, max_tokens=cfg.max_tokens)
    for epoch in strategy.schedule(cfg, data, policy):
        seen = np.sort(np.concatenate(epoch))
        assert np.array_equal(seen, np.arange(data.lengths.size))
        if cfg.max_tokens is not None and kind != "polyexec":
            for idx in epoch:   # the token budget holds at the strategy's padded length
                if len(idx) > 1:
                    rows, t = strategy.padded_shape(cfg, policy, len(idx),
                                                    int(data.lengths[idx].max()))
                    assert len(idx) * t <= cfg.max_tokens


def test_a_strategy_is_one_registered_class(monkeypatch):
    """Parsing, --help, the worker and the report find a new strategy through the registry."""
    monkeypatch.setattr(strategies, "REGISTRY", dict(REGISTRY))

    @register
    class HalfCap(Strategy):       # random batches padded to half the cap, or to the cap
        token = "half-cap"
        usage = "half-cap"
        description = "random batches, two buckets: half the cap and the cap"
        goal = 2.0

        def t_policy(self, cfg, data):
            return buckets.Fixed([cfg.cap // 2, cfg.cap])

    assert [s.name for s in parse_strategies("pad-max,half-cap")] == ["pad-max", "half-cap"]
    assert "half-cap: random batches, two buckets" in strategies_help()
    with pytest.raises(ValueError, match="token 'half-cap' is taken by HalfCap"):
        register(HalfCap)
    cfg = Config(source="uniform", num_examples=12, cap=32, batch_size=4, mode="infer",
                 hidden=4, embed=4, seed=5)
    result = run_strategy(HalfCap(), cfg, Files())
    data = load_data(cfg)
    assert result["strategy"] == "half-cap" and result["batching"] == "random"
    assert result["buckets"] == [16, 32] and result["steps"] == 2 * 3
    assert 1 <= result["compiles"] <= 2 and result["traces"] == 1
    shapes = [HalfCap().padded_shape(cfg, HalfCap().t_policy(cfg, data), len(i),
                                     int(data.lengths[i].max()))
              for ep in HalfCap().schedule(cfg, data, HalfCap().t_policy(cfg, data)) for i in ep]
    assert result["padding_efficiency"] == pytest.approx(
        2 * data.real_tokens / sum(b * t for b, t in shapes))
    row = {"tokens_per_s_warm": 10.0, "tokens_per_s_cold": 5.0}
    line = HalfCap().summary_line(row, {"tokens_per_s_warm": 30.0, "tokens_per_s_cold": 5.0}, {})
    assert line == "polyexec vs half-cap: 3.00x warm, 1.00x cold (goal 2x)"


def test_pack_is_one_registered_class_in_the_defaults():
    assert REGISTRY["pack"] is strategies.Pack and strategies.Pack.batching == "packed"
    assert "pack" in [s.name for s in parse_strategies(strategies.DEFAULT_STRATEGIES)]
    # --quick runs the default strategies (no --strategies given): pack among them.
    assert build_parser().parse_args(["--quick"]).strategies is None
    with pytest.raises(px.OptionError, match="pack: expected no ':' arguments"):
        parse_strategies("pack:4")


def test_a_default_strategy_the_workload_cannot_run_is_skipped_with_a_note(monkeypatch, capsys):
    """Without Grain, the default list runs without pack (a note says so); asked for by name,
    pack is a one-line usage error."""
    from bench import cli
    find_spec = strategies.importlib.util.find_spec
    monkeypatch.setattr(strategies.importlib.util, "find_spec",
                        lambda name, *a: None if name == "grain" else find_spec(name, *a))
    ran = []

    def fake_run_all(cfg, chosen, **kwargs):
        ran.extend(s.name for s in chosen)
        raise cli.WorkerError("stop here")

    monkeypatch.setattr(cli, "run_all", fake_run_all)
    with pytest.raises(SystemExit, match="stop here"):
        main(["--quick", "--no-progress"])
    assert ran == [s.name for s in parse_strategies(strategies.DEFAULT_STRATEGIES)
                   if s.name != "pack"]
    assert "note: pack skipped: --strategies pack: expected Grain to be installed" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--no-progress", "--strategies", "pack,polyexec"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("polyexec-bench: error: --strategies pack: expected Grain")


def test_repeat_alternates_the_order_and_gives_each_round_its_own_caches(monkeypatch):
    """``--repeat 3``: the limit, rounds in the listed order / reversed / listed, the limit
    again; a strategy that reads another's compile cache still runs after it, from its own
    round's cache; each round's layout choice is its own, so every round is cold."""
    from bench import cli
    jobs = []

    def fake_worker(job, workdir, on_event):
        jobs.append(job)
        return {"name": job["name"]}

    monkeypatch.setattr(cli, "run_worker", fake_worker)
    chosen = parse_strategies("pack,polyexec,polyexec-cached")
    passes, rounds = cli.run_all(Config(), chosen, progress=False, repeat=3)
    a, b, c = (s.name for s in chosen)
    assert (a, b, c) == ("pack", "polyexec", "polyexec-cached")
    assert [j["name"] for j in jobs] == [
        "limit", "pack (1/3)", "polyexec (1/3)", "polyexec-cached (1/3)",
        "polyexec (2/3)", "pack (2/3)", "polyexec-cached (2/3)",
        "pack (3/3)", "polyexec (3/3)", "polyexec-cached (3/3)", "limit (again)"]
    assert [[r["name"] for r in rnd] for rnd in rounds] == [
        [f"{s} ({k}/3)" for s in (a, b, c)] for k in (1, 2, 3)]
    own = [j for j in jobs if j["strategy"] != "limit"]
    assert len({j["choice_file"] for j in own}) == 3
    for k in (1, 2, 3):         # polyexec-cached reads the cache polyexec filled that round
        made, read = (next(j["cache_dir"] for j in own if j["name"] == f"{s} ({k}/3)")
                      for s in (b, c))
        assert made == read is not None
    assert len({j["cache_dir"] for j in own if j["strategy"] == b}) == 3
    assert passes == [{"name": "limit"}, {"name": "limit (again)"}]


def test_median_round_and_the_per_round_ratios():
    from bench import cli
    rounds = [[{"strategy": "pack", "tokens_per_s_warm": w, "tokens_per_s_cold": c},
               {"strategy": "polyexec", "tokens_per_s_warm": pw, "tokens_per_s_cold": pc}]
              for w, c, pw, pc in ((10.0, 5.0, 11.0, 4.0), (8.0, 4.0, 12.0, 6.0),
                                   (9.0, 6.0, 9.0, 3.0))]
    picked = cli.median_round(rounds)
    assert picked[0] is rounds[2][0] and picked[1] is rounds[0][1]   # 9 of 8/9/10; 11 of 9/11/12
    (line,) = cli.round_lines(rounds)
    assert line == ("polyexec / pack, each round side by side: warm 1.10x, 1.50x, 1.00x "
                    "(median 1.10x); cold 0.80x, 1.50x, 0.50x (median 0.80x)")
    assert cli.round_lines(rounds[:1]) == []


@pytest.mark.parametrize("model, batching", [("gru", dict(batch_size=3)),
                                             ("attention", dict(batch_size=None, max_tokens=192))])
def test_pack_trains_in_one_compile_and_reports_like_the_others(model, batching):
    """The pack strategy in-process, train mode: one compile (its own counter and XLA's
    events), row efficiency as bench.packing computes it, its steps, a finite epoch loss."""
    pytest.importorskip("grain")
    from bench import packing
    cfg = Config(model=model, source="uniform", num_examples=24, cap=64, seed=2, hidden=8,
                 embed=8, heads=2, **batching)
    result = run_strategy(parse_strategy("pack"), cfg, Files())
    data = load_data(cfg)
    packed_cfg = strategies.Pack().packed_config(cfg)   # under a budget: 192 // 64 = 3 rows
    assert packed_cfg.batch_size == 3
    epochs = [packing.pack_epoch(packed_cfg, data, e) for e in range(cfg.epochs)]
    assert result["strategy"] == "pack" and result["batching"] == "packed"
    assert result["compiles"] == result["traces"] == result["backend_compiles"] == 1
    assert result["compile_s"] > 0 and result["distinct_shapes"] == 1
    # Several examples a row: fewer steps than batches of 3 examples.
    assert result["steps"] == sum(map(len, epochs)) < 2 * math.ceil(data.lengths.size / 3)
    assert result["padding_efficiency"] == pytest.approx(
        packing.row_efficiency([b for ep in epochs for b in ep]))
    assert len(result["epoch_loss"]) == cfg.epochs and np.isfinite(result["epoch_loss"]).all()
    # The schedule: each packed batch's examples, every example once an epoch.
    for ep, batches in zip(strategies.Pack().schedule(cfg, data, None), epochs):
        assert [i.tolist() for i in ep] == [[i for r in b.examples for i in r] for b in batches]
        assert sorted(np.concatenate(ep).tolist()) == list(range(data.lengths.size))


def test_strategies_reject_arguments_they_do_not_take():
    with pytest.raises(px.OptionError, match="pad-max: expected no ':' arguments, received "
                                             "pad-max:3"):
        parse_strategies("pad-max:3")
    assert parse_strategy("fixed:64,16") == parse_strategies("fixed:16,64")[0]


def test_padded_batch_rows_and_lengths():
    data = load_data(Config(source="uniform", num_examples=10, cap=32, batch_size=4, seed=2))
    idx = np.array([3, 7])
    tokens, lengths = padded_batch(data, idx, 4, 32)
    assert tokens.shape == (4, 32) and lengths.tolist() == [*data.lengths[idx].tolist(), 0, 0]
    assert np.array_equal(tokens[:2], data.tokens[idx]) and not tokens[2:].any()


class _FakeBucketed:
    """Stands in for a Bucketed: warmup of a bucket returns when the test releases it."""

    def __init__(self):
        import threading
        self.release = {}
        self.threading = threading

    def warmup(self, *fixed, sizes, max_workers):
        (combo,) = sizes
        key = (combo["B"], combo["T"])
        self.release.setdefault(key, self.threading.Event()).wait(10)


def test_background_warmup_picks_ready_buckets_within_twice_the_size():
    import time
    f = _FakeBucketed()
    for key in [(8, 256), (8, 64), (8, 128)]:
        f.release[key] = f.threading.Event()
    warm = BackgroundWarmup(f, (), [(8, 256), (8, 64), (8, 128)])
    assert warm.shape_for(8, 64) == (8, 64)          # nothing ready: run (and compile) its own
    f.release[(8, 256)].set()
    deadline = time.time() + 5
    while warm.shape_for(8, 128) != (8, 256) and time.time() < deadline:
        time.sleep(0.01)
    assert warm.shape_for(8, 128) == (8, 256)        # 2x its size: upgraded
    assert warm.shape_for(8, 64) == (8, 64)          # 4x: waits for its own instead
    warm.mark_ready((8, 64))
    assert warm.shape_for(8, 64) == (8, 64)
    assert warm.shape_for(8, 100) == (8, 100)        # 256 > 2 x 100: its own
    f.release[(8, 64)].set()
    f.release[(8, 128)].set()
    warm.join()
    assert warm.shape_for(8, 100) == (8, 128)


def test_limit_shapes_add_a_cap_batch_of_tokens_for_short_groups():
    """With --batch-size, a group of mean length m is also timed at batch_size * cap // m
    rows (a packed batch's tokens); under --max-tokens the budget already sets the rows."""
    cfg = Config(source="uniform", num_examples=200, cap=64, batch_size=4, steps=None)
    data = load_data(cfg)
    groups = limit_shapes(cfg, data)
    assert len(groups) > 1
    for g in groups:
        assert g["rows"] == 4 and g["budget_rows"] == max(4, 4 * 64 // g["length"])
    assert any(g["budget_rows"] > 4 for g in groups)
    budget = Config(source="uniform", num_examples=200, cap=64, batch_size=None,
                    max_tokens=256, steps=None)
    assert all(g["budget_rows"] == g["rows"] for g in limit_shapes(budget, load_data(budget)))


def test_combine_limits_takes_the_fastest_pass_per_group():
    a = [{"real_tokens": 100, "tokens_per_s": 50.0}, {"real_tokens": 300, "tokens_per_s": 300.0}]
    b = [{"real_tokens": 100, "tokens_per_s": 100.0}, {"real_tokens": 300, "tokens_per_s": 100.0}]
    limit, rates = combine_limits([a, b], 400)
    assert rates == [100.0, 300.0] and limit == pytest.approx(400 / (1 + 1))


@pytest.mark.parametrize("argv, message", [
    (["--cap", "256", "--strategies", "fixed:32,128"],
     "expected a largest size >= the cap 256, received largest size 128"),
    (["--strategies", "polyexec,bogus"], "received unknown strategy 'bogus'"),
    (["--epochs", "1"], "Config: epochs: expected an int >= 2, received 1"),
    (["--lr", "-1"], "Config: learning_rate: expected a finite number > 0, received -1.0"),
    (["--lr", "inf"], "Config: learning_rate: expected a finite number > 0, received inf"),
    (["--lr", "nan"], "Config: learning_rate: expected a finite number > 0, received nan"),
    (["--lengths-file", "/nonexistent/lengths.txt"], "No such file or directory"),
    (["--repeat", "0"], "--repeat: expected an int >= 1, received 0"),
    (["--target-loss", "nan"], "--target-loss: expected a finite number > 0, received nan"),
    (["--model", "filter-mlp", "--strategies", "pack"],
     "--strategies pack: expected --model gru / lstm / attention, received --model filter-mlp"),
    (["--devices", "0"], "--devices: expected an int >= 1, received 0"),
    (["--devices", "2", "--batch-size", "7"],
     "--devices 2: expected --batch-size a multiple of 2 (every device holds whole rows), "
     "received --batch-size 7"),
    (["--devices", "3"], "--devices 3: expected --batch-size a multiple of 3 (every device "
                         "holds whole rows), received --batch-size 8"),      # --quick's 8 rows
    (["--devices", "2", "--max-tokens", "2048"],
     "--devices 2: expected --batch-size (a multiple of 2: every device holds whole rows), "
     "received --max-tokens 2048"),
    (["--devices", "2", "--strategies", "pad-max,polyexec"],
     "--strategies pad-max: expected --devices 1 (it runs on one device; over several: pack, "
     "polyexec, polyexec-cached), received --devices 2"),
    (["--devices", "2", "--model", "filter-mlp"],
     "--devices 2: expected --model gru / lstm / attention (the filter-mlp benchmark runs on "
     "one device), received --model filter-mlp"),
])
def test_bad_flags_are_one_line_usage_errors_before_any_worker(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--no-progress", *argv])
    assert exit_.value.code == 2
    *usage, error = capsys.readouterr().err.strip().splitlines()
    assert usage[0].startswith("usage: polyexec-bench")
    assert error.startswith("polyexec-bench: error: ") and message in error


@pytest.mark.parametrize("flag, target, message", [
    ("--json", "folder", "--json: expected a file path, received '{path}' which is a folder"),
    ("--json", "missing", "--json: expected a file in an existing folder, received '{path}' "
                          "(no folder '{path.parent}')"),
    ("--plot", "folder", "--plot: expected a file path, received '{path}' which is a folder"),
    ("--plot", "missing", "--plot: expected a file in an existing folder, received '{path}'"),
])
def test_output_paths_are_checked_before_any_worker(flag, target, message, tmp_path, capsys,
                                                    monkeypatch):
    from bench import cli
    path = tmp_path if target == "folder" else tmp_path / "missing" / "out.x"
    monkeypatch.setattr(cli, "run_all", lambda *a, **k: pytest.fail("a worker started"))
    for model in ("gru", "filter-mlp"):
        with pytest.raises(SystemExit) as exit_:
            main(["--quick", "--no-progress", "--model", model, flag, str(path)])
        assert exit_.value.code == 2
        *_, error = capsys.readouterr().err.strip().splitlines()
        assert error.startswith(f"polyexec-bench: error: {message.format(path=path)}")


def test_a_batch_size_above_the_examples_is_clamped_with_a_note():
    from bench.cli import clamp_batch_size
    cfg = Config(source="uniform", num_examples=30, cap=64, batch_size=100_000, steps=2)
    data = load_data(cfg)
    clamped, note = clamp_batch_size(cfg, data)
    assert clamped.batch_size == 30 and note == ("note: --batch-size 100000 is more than the 30 "
                                                 "examples; using --batch-size 30")
    assert np.array_equal(load_data(clamped).lengths, data.lengths)   # the same examples
    assert clamp_batch_size(clamped, data) == (clamped, None)
    assert clamp_batch_size(Config(batch_size=None, max_tokens=4096), data)[1] is None


def test_quick_preset_and_explicit_flags():
    cfg = config_from_args(build_parser().parse_args(["--quick", "--hidden", "24"]))
    assert (cfg.hidden, cfg.cap, cfg.mode, cfg.steps) == (24, 512, "infer", 6)
    cfg = config_from_args(build_parser().parse_args(["--max-tokens", "4096", "--dist", "bimodal"]))
    assert (cfg.batch_size, cfg.max_tokens, cfg.source, cfg.mode) == (None, 4096, "bimodal", "train")


@pytest.mark.parametrize("argv, batching", [
    ([], (None, 32 * 1024)),                      # the pack peer's 32 rows of the cap's tokens
    (["--cap", "512"], (None, 32 * 512)),
    (["--batch-size", "16"], (16, None)),
    (["--quick"], (8, None)),
    (["--devices", "2"], (32, None)),             # whole rows a device: rows, not tokens
])
def test_every_strategy_gets_the_same_tokens_a_step_by_default(argv, batching):
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.batch_size, cfg.max_tokens) == batching


def _doc():
    return {"workload": {}, "limit_tokens_per_s": 200.0, "results": [
        {"strategy": "exact", "compiles": 3, "traces": 3, "compile_s": 1.5,
         "padding_efficiency": 0.5, "tokens_per_s_cold": 50.0, "tokens_per_s_warm": 100.0,
         "fraction_of_limit_cold": 0.25, "fraction_of_limit_warm": 0.5, "peak_rss_mb": 10.0}]}


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("limit_tokens_per_s"), r"\$: expected exactly the keys"),
    (lambda d: d["results"][0].pop("traces"), r"missing \['traces'\]"),
    (lambda d: d["results"][0].update(extra=1), r"unexpected \['extra'\]"),
    (lambda d: d["results"][0].update(compiles=1.0), r"compiles: expected int"),
    (lambda d: d["results"][0].update(padding_efficiency=1.5), "in \\(0, 1\\]"),
    (lambda d: d["results"][0].update(fraction_of_limit_warm=0.9), "tokens_per_s_warm / limit"),
    (lambda d: d.update(limit_tokens_per_s=float("nan")), "finite number > 0"),
    (lambda d: d["results"].append(dict(d["results"][0])), "appears twice"),
])
def test_schema_rejects(mutate, message):
    doc = _doc()
    assert report.validate(doc) is doc
    mutate(doc)
    with pytest.raises(report.SchemaError, match=message):
        report.validate(doc)


def test_filter_mlp_runs_or_says_it_is_missing(tmp_path):
    if importlib.util.find_spec("bench.filter_mlp") is None:
        with pytest.raises(SystemExit, match="bench/filter_mlp.py .* is not in this installation"):
            main(["--model", "filter-mlp"])
    else:
        out = tmp_path / "f.json"
        assert main(["--model", "filter-mlp", "--rows", "256", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["workload"]["model"] == "filter-mlp" and doc["result"]


def test_seq2seq_packs_the_same_examples_as_the_peer_to_the_same_losses(tmp_path):
    """The encoder-decoder, packed by polyexec from unchanged code and by the seqio-style peer
    by hand, trained on the same examples: `bench.seq2seq.run` raises unless every epoch's
    loss agrees across strategies; polyexec packs at the peer's rows in one compile."""
    out = tmp_path / "s.json"
    assert main(["--model", "seq2seq", "--num-examples", "40", "--cap", "32", "--hidden", "8",
                 "--batch-size", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["model"] == "seq2seq" and doc["workload"]["examples"] == 40
    runs = doc["result"]
    assert set(runs) == {"peer", "polyexec-pack", "polyexec", "polyexec-fit"}
    # fit on the pairs as a user runs it: its own steps, every epoch at one layout.
    assert len({e["layout"] for e in runs["polyexec-fit"]}) == 1
    assert runs["polyexec-fit"][-1]["loss"] < runs["polyexec-fit"][0]["loss"]
    assert runs["polyexec-pack"][-1]["compiles"] == runs["peer"][-1]["compiles"] == 1
    assert runs["polyexec-pack"][-1]["efficiency"] >= runs["peer"][-1]["efficiency"]
    assert runs["polyexec"][-1]["compiles"] > 1        # padded: a bucket per batch shape


# --------------------------------------------------------------------- --quick end to end


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # Blocking warmup: every batch runs in its own bucket, so the padding accounting is exact
    # (the background warmup is exercised by test_quick_train_mode).
    # --layout pad: these tests count padded buckets (the packed choice has its own test).
    argv = ["--quick", *BRIEF_LIMIT, "--warmup", "blocking", "--layout", "pad", "--strategies", ALL,
            "--json", str(out / "q.json"), "--plot", str(out / "q.png")]
    run = run_once(tmp_path_factory, "bench-quick",
                   lambda: {"doc": _run_quick(argv)[0], "out": str(out)})
    return run["doc"], pathlib.Path(run["out"]), config_from_args(build_parser().parse_args(argv))


def test_quick_json_matches_the_schema(quick):
    doc, out, _ = quick
    report.validate(doc)
    assert [r["strategy"] for r in doc["results"]] == [s.name for s in parse_strategies(ALL)]
    assert (out / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Two limit passes (before and after the strategies); the limit takes each group's fastest.
    passes = doc["workload"]["limit"]["passes"]
    assert len(passes) == 2
    assert doc["limit_tokens_per_s"] >= max(p["limit_tokens_per_s"] for p in passes) * (1 - 1e-9)
    # The first pass compiles each shape with jax.jit (the second loads them): polyexec's
    # compile seconds a shape are reported against those, and its plan's stages apart.
    assert all(g["compile_s"] > 0 for g in passes[0]["groups"])
    # Each group is timed at --batch-size rows and, when more, at a cap batch's tokens; its
    # rate is the faster shape's.
    cfg = quick[2]
    for g in passes[0]["groups"]:
        rows = [sh["rows"] for sh in g["shapes"]]
        assert rows == sorted(set([cfg.batch_size, cfg.batch_size * cfg.cap // g["length"]]))
        assert g["tokens_per_s"] == max(sh["tokens_per_s"] for sh in g["shapes"])
        assert all(sh["tokens_per_s"] == pytest.approx(sh["rows"] * g["length"]
                                                       / sh["seconds_per_step"])
                   for sh in g["shapes"])
    plan = doc["workload"]["per_strategy"]["polyexec"]["plan_seconds"]
    assert {"trace", "rewrite"} <= set(plan) and all(s > 0 for s in plan.values())
    line = report.compile_line(next(r for r in doc["results"] if r["strategy"] == "polyexec"),
                               doc["workload"]["per_strategy"]["polyexec"], passes)
    assert line.startswith("compiles: polyexec ") and "trace " in line


def _schedule_shapes(cfg, name, doc=None):
    data = load_data(cfg)
    strategy = parse_strategy(name)
    policy = strategy.t_policy(cfg, data)
    if policy is None and strategy.batching == "grouped":   # --buckets auto: the worker's choice, as reported
        run = doc["workload"]["per_strategy"][name]
        policy = buckets.Auto(tuple(run["buckets"]), tuple(run["partial_rows"]))
    epochs = strategy.schedule(cfg, data, policy)
    shapes = [strategy.padded_shape(cfg, policy, len(i), int(data.lengths[i].max()))
              for ep in epochs for i in ep]
    real = sum(int(data.lengths[i].sum()) for ep in epochs for i in ep)
    return data, policy, shapes, real


def test_quick_compile_counts_fit_each_strategy(quick):
    doc, _, cfg = quick
    by = {r["strategy"]: r for r in doc["results"]}
    extra = doc["workload"]["per_strategy"]
    assert by["pad-max"]["compiles"] == 1 and by["pad-max"]["traces"] == 1

    _, _, shapes, _ = _schedule_shapes(cfg, "exact")
    distinct_t = {t for _, t in shapes}
    assert len(distinct_t) > 2          # the quick workload must exercise exact's weakness
    assert by["exact"]["compiles"] == len(distinct_t) == by["exact"]["traces"]

    _, policy, shapes, _ = _schedule_shapes(cfg, "polyexec", doc)
    assert extra["polyexec"]["bucket_count"] == len(policy.sizes)
    # One compile per (rows, length) shape the batches use, plus the one --buckets auto measured
    # (the largest length's full batch; usually one of them).
    measured = (cfg.batch_size, max(policy.sizes))
    assert by["polyexec"]["compiles"] == len(set(shapes) | {measured})
    assert by["polyexec"]["traces"] == 1
    # The second process reuses the choice and finds every shape in the persistent cache.
    assert by["polyexec-cached"]["compiles"] == 0
    assert extra["polyexec-cached"]["cache_hits"] == len(set(shapes))

    _, _, shapes, _ = _schedule_shapes(cfg, "pow2")
    assert by["pow2"]["compiles"] == len(set(shapes)) and by["pow2"]["traces"] == 1


def test_quick_polyexec_nomask_runs_beside_polyexec(quick):
    """The same grouped batches and buckets with the logical-length rewrite off: its own compile
    cache (nothing of polyexec's found), the same padding, and the same loss (the loss masks
    by the lengths itself, so the rewrite changes no value)."""
    doc, _, cfg = quick
    by = {r["strategy"]: r for r in doc["results"]}
    extra = doc["workload"]["per_strategy"]
    _, _, shapes, _ = _schedule_shapes(cfg, "polyexec", doc)   # polyexec's choice, reused
    assert extra["polyexec-nomask"]["buckets"] == extra["polyexec"]["buckets"]
    assert by["polyexec-nomask"]["compiles"] == len(set(shapes)) >= 1
    assert extra["polyexec-nomask"]["cache_hits"] == 0
    assert by["polyexec-nomask"]["traces"] == 1
    nomask, masked = by["polyexec-nomask"], by["polyexec"]
    assert nomask["padding_efficiency"] == pytest.approx(masked["padding_efficiency"])
    np.testing.assert_allclose(extra["polyexec-nomask"]["final_loss"],
                               extra["polyexec"]["final_loss"], rtol=2e-5)


def test_quick_padding_efficiency(quick):
    doc, _, cfg = quick
    by = {r["strategy"]: r for r in doc["results"]}
    eff = {k: by[k]["padding_efficiency"] for k in by}
    assert eff["pad-max"] < eff["pow2"] <= eff["polyexec"]
    assert eff["pow2"] <= eff["exact"]
    assert eff["polyexec"] == pytest.approx(eff["polyexec-cached"])
    # The accounting itself, recomputed from the schedule: real tokens / rows x padded length.
    for name in ("pad-max", "exact", "polyexec"):
        _, _, shapes, real = _schedule_shapes(cfg, name, doc)
        assert eff[name] == pytest.approx(real / sum(b * t for b, t in shapes))
    data = load_data(cfg)
    batches = cfg.epochs * math.ceil(data.lengths.size / cfg.batch_size)
    assert eff["pad-max"] == pytest.approx(
        cfg.epochs * data.real_tokens / (batches * cfg.batch_size * cfg.cap))


def test_quick_padding_never_changes_the_loss(quick):
    """The random-batch strategies see the same batches; only the padding differs."""
    doc, _, _ = quick
    losses = [doc["workload"]["per_strategy"][name]["final_loss"] for name in RANDOM]
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses, losses[0], rtol=2e-5)


# Train mode, one device: the random-batch strategies, pack (with grain) and polyexec, with
# --buckets 2 (a plan that does not depend on the devices). test_quick_train_mode reads it, and
# test_quick_devices_2_matches_one_device_on_the_same_batches compares a 2-device run with it.
TRAIN_FLAGS = ["--quick", "--mode", "train", "--steps", "3", "--buckets", "2"]


@pytest.fixture(scope="module")
def train_one(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-train") / "t.json"
    names = "pad-max,exact," + ("pack," if HAS_GRAIN else "") + "polyexec"
    return run_once(tmp_path_factory, "bench-train", lambda: _run_quick(
        [*TRAIN_FLAGS, *BRIEF_LIMIT, "--strategies", names, "--json", str(out)])[0])


def test_quick_train_mode(train_one):
    """The train step (value_and_grad + Adam) through pad-max, exact and polyexec."""
    doc = train_one
    by = {r["strategy"]: r for r in doc["results"]}
    assert doc["workload"]["mode"] == "train"
    assert by["pad-max"]["compiles"] == 1
    assert 1 <= by["polyexec"]["compiles"] <= 2
    per = doc["workload"]["per_strategy"]
    assert per["polyexec"]["warmup"] == "background"
    # Batches that ran in a larger compiled bucket while theirs compiled cost padding (at most
    # twice their own bucket), never a result.
    cfg = config_from_args(build_parser().parse_args(TRAIN_FLAGS))
    _, _, shapes, real = _schedule_shapes(cfg, "polyexec")
    own = real / sum(b * t for b, t in shapes)
    assert own / 2 <= by["polyexec"]["padding_efficiency"] <= own * (1 + 1e-9)
    if per["polyexec"]["upgraded_batches"] == 0:
        assert by["polyexec"]["padding_efficiency"] == pytest.approx(own)
    # Same random batches, same Adam steps: padding to the cap and exact shapes agree.
    np.testing.assert_allclose(per["pad-max"]["final_loss"], per["exact"]["final_loss"], rtol=1e-4)


def test_quick_devices_2_matches_one_device_on_the_same_batches(train_one, tmp_path):
    """``--devices 2``: pack (Grain's rows, the segment-id step under jit with in/out
    shardings) and polyexec (fit's data parallelism: the bucketed step's shardings) split
    each batch's rows over a 2-device Mesh. Their batches do not depend on the devices (the
    same Grain rows; the same length-grouped plan with --buckets 2, 8 rows a batch already a
    multiple of 2), so in train mode -- Adam steps, gradients all-reduced over the devices --
    every epoch's loss equals one device's (the train_one run) within float reassociation.
    The workers get the CPU device count through XLA_FLAGS; this process needs no devices of
    its own."""
    pytest.importorskip("grain")
    out = tmp_path / "d2.json"
    two_doc, printed = _run_quick([*TRAIN_FLAGS, *BRIEF_LIMIT, "--strategies", "pack,polyexec",
                                   "--devices", "2", "--json", str(out)])
    docs = {1: train_one, 2: two_doc}
    assert "devices" not in docs[1]["workload"]             # one device: the output as before
    dev = docs[2]["workload"]["devices"]
    assert dev["count"] == 2 and dev["state_on_devices"] == {"pack": 2, "polyexec": 2}
    assert "devices: 2 -- pack, polyexec split each batch's 8 rows over a 2-device Mesh" in printed
    for name in ("pack", "polyexec"):
        one, two = (docs[n]["workload"]["per_strategy"][name] for n in (1, 2))
        assert one["steps"] == two["steps"]
        assert np.isfinite(one["epoch_loss"]).all()
        np.testing.assert_allclose(two["epoch_loss"], one["epoch_loss"], rtol=1e-5)
        np.testing.assert_allclose(two["final_loss"], one["final_loss"], rtol=1e-5)


# Inference, --buckets auto and --layout auto (the defaults): pack (with grain) beside polyexec
# and polyexec-cached. test_quick_pack_beside_polyexec and
# test_quick_layout_auto_follows_its_prediction read it.
INFER_FLAGS = ["--quick", "--steps", "3"]


@pytest.fixture(scope="module")
def infer_auto(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-infer") / "a.json"
    names = ("pack," if HAS_GRAIN else "") + "polyexec,polyexec-cached"
    return tuple(run_once(tmp_path_factory, "bench-infer", lambda: _run_quick(
        [*INFER_FLAGS, *BRIEF_LIMIT, "--strategies", names, "--json", str(out)])))


def test_quick_pack_beside_polyexec(infer_auto):
    """``--quick --strategies pack,polyexec,...``: the pack row (one compile, Grain's row
    efficiency, a finite loss) and the polyexec / pack ratios in the summary. In inference
    the weights never change, so both epochs' mean losses -- summed nats / predictions over
    the same examples, however batched -- agree between the two."""
    pytest.importorskip("grain")
    from bench import packing
    doc, printed = infer_auto
    by = {r["strategy"]: r for r in doc["results"]}
    per = doc["workload"]["per_strategy"]
    assert list(by) == ["pack", "polyexec", "polyexec-cached"]
    assert doc["workload"]["batching"]["pack"] == "packed"
    assert by["pack"]["compiles"] == 1 and by["pack"]["traces"] == 1
    cfg = config_from_args(build_parser().parse_args(INFER_FLAGS))
    data = load_data(cfg)
    epochs = [packing.pack_epoch(cfg, data, e) for e in range(cfg.epochs)]
    assert by["pack"]["padding_efficiency"] == pytest.approx(
        packing.row_efficiency([b for ep in epochs for b in ep]))
    assert per["pack"]["steps"] == sum(map(len, epochs))
    assert np.isfinite(per["pack"]["epoch_loss"]).all() and np.isfinite(per["pack"]["final_loss"])
    np.testing.assert_allclose(per["pack"]["epoch_loss"], per["polyexec"]["epoch_loss"],
                               rtol=1e-5)
    ratio = (f"polyexec vs pack: "
             f"{by['polyexec']['tokens_per_s_warm'] / by['pack']['tokens_per_s_warm']:.2f}x warm, "
             f"{by['polyexec']['tokens_per_s_cold'] / by['pack']['tokens_per_s_cold']:.2f}x cold")
    assert ratio in printed     # rich may wrap the line: _run_quick joins it
    # Time to a loss: by default the highest last-epoch loss (the same examples' losses agree);
    # each strategy's seconds run to the end of the first epoch at or below it.
    to_loss = doc["workload"]["time_to_loss"]
    assert to_loss["target"] == max(x["epoch_loss"][-1] for x in per.values())
    for name, x in per.items():
        k = next(i for i, loss in enumerate(x["epoch_loss"], 1) if loss <= to_loss["target"])
        assert to_loss["epoch"][name] == k
        assert to_loss["seconds"][name] == pytest.approx(sum(x["epoch_seconds"][:k]))
    assert "time to mean epoch loss <=" in printed


def test_quick_layout_auto_follows_its_prediction(infer_auto):
    """``--layout auto`` (the default): polyexec times its packed step on real batches and
    pins the layout its own predictions favour; a packed run's padding efficiency is the
    predicted one (the plans it ran are the plans it priced), in one compile that the cached
    worker then loads. The run's predicted seconds are printed beside its clock."""
    doc, printed = infer_auto
    by = {r["strategy"]: r for r in doc["results"]}
    auto = doc["workload"]["per_strategy"]["polyexec"]["auto"]
    pack, pad = auto["predicted_pack"], auto["predicted_pad"]
    assert auto["layout"] == ("pack" if pack["seconds"] <= pad["seconds"] else "pad")
    if auto["layout"] == "pack":
        assert doc["workload"]["batching"]["polyexec"] == "packed"
        assert by["polyexec"]["padding_efficiency"] == pytest.approx(
            auto["predicted_padding_efficiency"])
        assert by["polyexec"]["compiles"] == 1 and by["polyexec"]["traces"] == 1
        assert by["polyexec-cached"]["compiles"] == 0
        # The fastest of three timed calls a row length prices it: real batches where the
        # plan has them (kept as the run's first), padding for the rest (not counted here).
        assert 1 <= auto["timed_steps"] <= 3 * len(auto["row_lengths"])
    assert "polyexec: predicted " in printed and " for the run (" in printed
    np.testing.assert_allclose(
        doc["workload"]["per_strategy"]["polyexec-cached"]["epoch_loss"],
        doc["workload"]["per_strategy"]["polyexec"]["epoch_loss"], rtol=1e-6)


@pytest.mark.parametrize("name", ["bench", "bench.workloads", "bench.strategies", "bench.report",
                                  "bench.cli", "bench.devices", "bench.seq2seq"])
def test_docstring_examples(name):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_quick_token_budget(tmp_path):
    """--max-tokens: pad-max is still one shape, a polyexec bucket still one compile."""
    out = tmp_path / "m.json"
    assert main(["--quick", "--dist", "bimodal", "--max-tokens", "2048", "--buckets", "3",
                 "--limit-rounds", "1", "--limit-seconds", "0.05",
                 "--strategies", "pad-max,pow2,polyexec", "--json", str(out),
                 "--no-progress"]) == 0
    doc = report.validate(json.loads(out.read_text()))
    by = {r["strategy"]: r for r in doc["results"]}
    assert by["pad-max"]["compiles"] == 1
    assert 1 <= by["polyexec"]["compiles"] <= 3
    cfg = config_from_args(build_parser().parse_args(
        ["--quick", "--dist", "bimodal", "--max-tokens", "2048", "--buckets", "3"]))
    _, _, shapes, _ = _schedule_shapes(cfg, "pow2")
    assert by["pow2"]["compiles"] == len(set(shapes))      # (rows, length) pairs
    # Under a budget random batches are cut at each strategy's padded length, so they differ.
    assert "cut per strategy" in doc["workload"]["note"]


@pytest.mark.parametrize("part", ["step", "gradient"])
def test_same_rows_runs_both_packed_programs_on_the_same_examples(tmp_path, part):
    """``python -m bench.same_rows``: polyexec's packed step (or value_and_grad of its loss)
    and the peer's, at the peer's first batch, give the same loss from the same weights (it
    exits 1 otherwise), and each is timed once a round."""
    pytest.importorskip("grain")
    from bench import same_rows
    out = tmp_path / "same.json"
    assert same_rows.main(["--hidden", "16", "--embed", "16", "--cap", "64", "--rows", "4",
                           "--rounds", "2", "--part", part, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == part
    assert doc["losses"]["polyexec"] == pytest.approx(doc["losses"]["peer"], rel=1e-4)
    assert all(len(doc[name]["seconds"]) == 2 and doc[name]["fastest_s"] > 0
               for name in ("polyexec", "peer"))
