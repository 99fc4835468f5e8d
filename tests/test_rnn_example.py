"""The example's CLI end to end (tiny config), its data split and its sampler."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import polyexec as px
from examples.rnn import data as corpus_data, train
from examples.rnn.generate import STOP_BYTES, generate, sample
from examples.rnn.model import CharLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--limit", "150", "--epochs", "1", "--hidden", "16", "--embed", "8", "--cap", "64",
        "--buckets", "optimal:2", "--batch-size", "16", "--samples", "2", "--sample-len", "40",
        "--no-progress"]


def run_cli(args, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"),
               JAX_PLATFORMS="cpu")
    env.pop("POLYEXEC_CACHE_DIR", None)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "examples.rnn.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_cli_runs_end_to_end_without_a_cache(tmp_path):
    out = run_cli([*TINY, "--no-cache", "--metrics", str(tmp_path / "m.jsonl")], tmp_path)
    for section in ["corpus: 150 sentences", "cap 64:", "padding efficiency",
                    "polymorphism: plan.reshaping_is_impossible = False", "warmup: 4 buckets",
                    "epoch 1: train loss", "validation loss:", "nats/char", "train step buckets",
                    "tokens/s", "samples (each stops"]:
        assert section in out, f"missing {section!r} in:\n{out}"
    # --no-cache: nothing written to the default cache folder
    assert not os.path.exists(tmp_path / "xdg" / "polyexec")
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    epoch = [r for r in records if r["kind"] == "epoch"]
    assert len(epoch) == 1 and epoch[0]["val_loss"] > 0
    assert epoch[0]["compiles"] == 4          # 2 length buckets x (train step + eval step)


def test_cli_second_run_loads_every_bucket_from_the_persistent_cache(tmp_path):
    cache = tmp_path / "cache"
    args = [*TINY, "--cache-dir", str(cache), "--samples", "0"]
    warmups = []
    for i in range(2):
        run_cli([*args, "--metrics", str(tmp_path / f"m{i}.jsonl")], tmp_path)
        warmups.append(next(json.loads(l) for l in open(tmp_path / f"m{i}.jsonl")
                            if json.loads(l)["kind"] == "warmup"))
    cold, warm = warmups
    assert cold["compiles"] == warm["compiles"] == 4      # buckets made ready, both runs
    assert cold["xla_compiles"] >= 4 and cold["cache_hits"] == 0
    assert warm["xla_compiles"] == 0 and warm["cache_hits"] == 4
    assert os.listdir(cache)


def test_cli_rejects_a_bad_flag_with_one_line_and_no_traceback():
    """The command itself, as a user runs it (the in-process cases below cover the rest)."""
    proc = subprocess.run([sys.executable, "-m", "examples.rnn.train", "--cap", "-5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    *usage, error = proc.stderr.strip().splitlines()
    assert usage[0].startswith("usage: python -m examples.rnn.train")
    assert error == ("python -m examples.rnn.train: error: argument --cap: expected an int >= 2 "
                     "or 0 (no cap), received '-5'")


@pytest.mark.parametrize("argv, message", [
    (["--limit", "0"], "argument --limit: expected an int >= 2, received '0'"),
    (["--epochs", "-1"], "argument --epochs: expected an int >= 0, received '-1'"),
    (["--hidden", "0"], "argument --hidden: expected an int >= 1, received '0'"),
    (["--lr", "0"], "argument --lr: expected a finite number > 0, received '0'"),
    (["--lr", "inf"], "argument --lr: expected a finite number > 0, received 'inf'"),
    (["--lr", "nan"], "argument --lr: expected a finite number > 0, received 'nan'"),
    (["--sample-len", "3"], "argument --sample-len: expected an int >= 5, received '3'"),
    (["--buckets", "square:3"],
     "argument --buckets: expected one of auto, optimal[:K], pow2, fixed:S1,S2,..., multiple:K, "
     "received 'square:3'"),
    (["--buckets", "optimal:x"], "argument --buckets: 'optimal:x': expected K an int >= 1"),
    (["--buckets", "fixed:8,0"], "argument --buckets: 'fixed:8,0': Fixed: sizes[1]: expected"),
    (["--no-cache", "--cache-dir", "x"], "argument --cache-dir: not allowed with argument --no-cache"),
    # Before JAX sees it: `bad:addr` crashed JAX's runtime (rc 139).
    (["--coordinator", "bad:addr", "--num-processes", "2", "--process-id", "1"],
     "argument --coordinator: expected HOST:PORT with PORT an int from 1 to 65535 (e.g. "
     "10.0.0.2:1234), received 'bad:addr'"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
     "argument --coordinator: expected HOST:PORT with PORT an int from 1 to 65535"),
    (["--coordinator", "localhost:65536", "--num-processes", "2", "--process-id", "1"],
     "argument --coordinator: expected HOST:PORT with PORT an int from 1 to 65535"),
    (["--coordinator", ":80", "--num-processes", "2", "--process-id", "1"],
     "argument --coordinator: expected HOST:PORT with PORT an int from 1 to 65535"),
    (["--coordinator-timeout", "0"], "argument --coordinator-timeout: expected an int >= 1"),
    # Found out after parsing, by the code that knows: still one line.
    (["--limit", "40", "--cap", "64", "--buckets", "fixed:8"],
     "--buckets: expected a largest bucket >= the longest training sentence"),
    (["--limit", "40", "--cap", "64", "--hidden", "4", "--embed", "4", "--devices", "64"],
     "fit: devices: expected an int from 1 to"),
    (["--limit", "40", "--cap", "64", "--buckets", "fixed:16,64", "--max-tokens", "32"],
     "fit: max_tokens: expected at least 64 (one row of the longest bucket, for the longest "
     "example), received 32"),
])
def test_cli_bad_flags_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    *_, error = err.strip().splitlines()
    assert error.startswith("python -m examples.rnn.train: error: ") and message in error, err


def test_cli_reports_fits_refusal_in_one_line_and_trains_with_train_on_padding(monkeypatch,
                                                                              capsys):
    """The example's loss edited into one padding may change (a weight from a triangular solve
    along T, which has no rule; token dropout, the edit here before, is padding-safe now):
    fit's refusal, naming the line, is a usage error; --train-on-padding trains it anyway, with
    the executor's warning."""
    import jax.numpy as jnp

    from examples.rnn import model

    def unsafe_loss(m, batch):
        T = batch["tokens"].shape[1]
        w = jax.scipy.linalg.solve_triangular(2 * jnp.eye(T), jnp.ones(T), lower=True)
        return model.lm_loss(m, batch) * jnp.mean(w)

    monkeypatch.setattr(train, "lm_loss", unsafe_loss)
    argv = ["--limit", "24", "--epochs", "1", "--hidden", "4", "--embed", "4", "--cap", "32",
            "--buckets", "fixed:32", "--samples", "0", "--no-cache", "--no-progress"]
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 2
    *_, error = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"python -m examples\.rnn\.train: error: fit: loss_fn: expected a train "
                        r"step that padding cannot change \(padding-safe\), received one that is "
                        r"not: .*test_rnn_example\.py:\d+: `w = jax\.scipy\.linalg\.solve_triangular"
                        r"\(.*`: triangular_solve: no rule for triangular_solve on a length axis"
                        r"( \(and \d+ more\))?; .*, or pass "
                        r"train_on_padding=True to train on it anyway", error), error
    with pytest.warns(UserWarning, match="train_step is not padding-safe"):
        out = train.main([*argv, "--train-on-padding"])
    assert out["val_loss"] > 0


def test_cli_reports_a_non_finite_loss_in_one_line_with_its_examples(monkeypatch, capsys):
    """A loss that is NaN stops the run (rc 1, not a usage error), one line naming the step and
    the examples, no traceback (--on-nonfinite skip is fit's option, tested in test_fit_batch)."""
    import jax.numpy as jnp

    from examples.rnn import model

    monkeypatch.setattr(train, "lm_loss", lambda m, batch: model.lm_loss(m, batch) * jnp.nan)
    argv = ["--limit", "24", "--epochs", "1", "--hidden", "4", "--embed", "4", "--cap", "32",
            "--buckets", "fixed:32", "--samples", "0", "--no-cache", "--no-progress"]
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    *_, error = err.strip().splitlines()
    assert re.fullmatch(r"python -m examples\.rnn\.train: error: fit: expected a finite loss and "
                        r"gradient at every step, received the loss not finite at step 1 \(epoch "
                        r"0, .*on the examples data\[i\] for i in \[[\d, ]+\] \(\d+ examples\).*"
                        r"on_nonfinite='skip' to skip such steps", error), error


def test_corpus_split_is_deterministic_and_capped():
    a = corpus_data.load(cap=64, limit=200)
    b = corpus_data.load(cap=64, limit=200)
    assert a.train == b.train and a.validation == b.validation
    assert len(a.validation) == 20 and len(a.train) == 180
    assert not set(a.train) & set(a.validation) or len(set(a.train)) < len(a.train)
    assert max(map(len, a.train + a.validation)) <= 64
    full = corpus_data.load(cap=64, limit=200)
    raw = corpus_data.load(cap=None, limit=200)
    assert full.capped == sum(len(s) > 64 for s in raw.train + raw.validation) > 0


def test_sampler_stops_at_a_sentence_end_and_respects_the_bound():
    model = CharLM(embed=8, hidden=16, key=jax.random.PRNGKey(0))
    prompts = [b"The ", b"A", b"In the"]
    out = generate(model, prompts, seed=1, max_len=48, temperature=1.0)
    assert len(out) == 3
    for prompt, text in zip(prompts, out):
        assert text.startswith(prompt) and len(text) <= 48
        if len(text) < 48:                       # stopped early: only at a sentence end
            assert text[-1] in STOP_BYTES
            assert not any(b in STOP_BYTES for b in text[len(prompt):-1])
    # The count is data-dependent, from one compiled loop: a model that always predicts '.'
    # stops right after each prompt; one that always predicts 'a' fills the buffer.
    import equinox as eqx
    prompts = np.full((4, 48), ord("x"), np.int32)
    plens = np.array([1, 5, 20, 47])
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    for byte, expected in [(ord("."), plens + 1), (ord("a"), np.full(4, 48))]:
        biased = eqx.tree_at(lambda m: m.head.bias, model,
                             np.where(np.arange(256) == byte, 100.0, 0.0).astype(np.float32))
        buf, counts = sample(biased, prompts, plens, keys, max_len=48, temperature=0.0)
        np.testing.assert_array_equal(np.asarray(counts), expected)
        buf = np.asarray(buf)
        for r, n in enumerate(plens):
            assert (buf[r, n:expected[r]] == byte).all() and (buf[r, :n] == ord("x")).all()
    with pytest.raises(px.OptionError, match="prompts: expected 1 to 47 bytes each"):
        generate(model, [b""], max_len=48)


def test_unmasked_loss_and_hand_masked_loss_give_the_same_training_run():
    """The example's loss has no mask (the rewrite makes each row its own length); with the
    rewrite off, the same loss masked by hand. Both runs must end at the same validation loss
    and the same parameters: the unmasked model is exact, not approximately so."""
    import optax

    from examples.rnn.model import loss_and_count, loss_fn, masked_loss_and_count, masked_loss_fn
    from polyexec import training

    corpus = corpus_data.load(cap=48, limit=120)
    results = {}
    for masking, loss, count in ((True, loss_fn, loss_and_count),
                                 (False, masked_loss_fn, masked_loss_and_count)):
        model = CharLM(embed=8, hidden=16, key=jax.random.PRNGKey(0))
        results[masking] = training.fit(
            model, loss, corpus.train, validation=corpus.validation, eval_fn=count,
            optimizer=optax.adam(1e-2), epochs=1, batch_size=16, buckets=[48], cache=False,
            verbose=False, seed=0, masking=masking)
    on, off = results[True], results[False]
    assert on.train_step.plan.padding_safe and on.val_loss > 0
    np.testing.assert_allclose(on.val_loss, off.val_loss, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(on.model), jax.tree_util.tree_leaves(off.model)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flag, target, message", [
    ("--checkpoint-dir", "file", "--checkpoint-dir: expected a folder (created if missing), "
                                 "received '{path}' which is a file"),
    ("--cache-dir", "file", "--cache-dir: expected a folder (created if missing), received "
                            "'{path}' which is a file"),
    ("--metrics", "folder", "--metrics: expected a file path, received '{path}' which is a folder"),
    ("--metrics", "missing", "--metrics: expected a file in an existing folder, received '{path}' "
                             "(no folder '{path.parent}')"),
])
def test_cli_output_paths_are_checked_before_any_work(flag, target, message, tmp_path, capsys,
                                                      monkeypatch):
    path = {"file": tmp_path / "a-file", "folder": tmp_path,
            "missing": tmp_path / "missing" / "m.jsonl"}[target]
    if target == "file":
        path.write_text("x")
    # Before any work: the corpus is never read.
    monkeypatch.setattr(corpus_data, "load", lambda **_: pytest.fail("read the corpus"))
    with pytest.raises(SystemExit) as exit_:
        train.main(["--limit", "20", flag, str(path)])
    assert exit_.value.code == 2
    *_, error = capsys.readouterr().err.strip().splitlines()
    assert error == f"python -m examples.rnn.train: error: {message.format(path=path)}"


def test_cli_output_folders_are_created(tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    def stop(**_):
        raise Stop

    monkeypatch.setattr(corpus_data, "load", stop)
    with pytest.raises(Stop):
        train.main(["--checkpoint-dir", str(tmp_path / "ck" / "a"), "--metrics",
                    str(tmp_path / "m.jsonl")])
    assert (tmp_path / "ck" / "a").is_dir() and os.listdir(tmp_path / "ck" / "a") == []
    assert not (tmp_path / "m.jsonl").exists()      # checked, not written


def test_cli_batch_size_above_the_data_is_clamped_with_a_note(tmp_path, capsys):
    out = train.main(["--limit", "24", "--batch-size", "100000", "--epochs", "1", "--hidden", "4",
                      "--embed", "4", "--cap", "32", "--buckets", "fixed:32", "--samples", "0",
                      "--no-cache", "--no-progress"])
    text = " ".join(capsys.readouterr().out.split())     # rich wraps long lines
    assert "note: batch_size=100000 is more than the 22 training examples; using batch_size=22" \
        in text
    rows = {r["bucket"][0] for r in out["history"] if r["kind"] == "step"}
    assert rows == {22}


def test_the_example_trains_in_fits_batch_form_exactly_as_in_the_shorthand():
    """`lm_loss(model, batch)` on ``{"tokens": ...}`` examples (the example's form) and
    `loss_fn(model, tokens, lengths)` on bytes (the shorthand) are the same training run, bit
    for bit."""
    import optax

    from examples.rnn.model import lm_loss, lm_loss_and_count, loss_and_count, loss_fn
    from polyexec import training

    corpus = corpus_data.load(cap=48, limit=80)
    runs = []
    for loss, count, train_set, val_set, specs in (
            (loss_fn, loss_and_count, corpus.train, corpus.validation, None),
            (lm_loss, lm_loss_and_count, corpus_data.examples(corpus.train),
             corpus_data.examples(corpus.validation), corpus_data.SPECS)):
        runs.append(training.fit(
            CharLM(embed=8, hidden=16, key=jax.random.PRNGKey(0)), loss, train_set,
            validation=val_set, eval_fn=count, specs=specs, optimizer=optax.adam(1e-2),
            epochs=1, batch_size=16, buckets=[48], cache=False, verbose=False))
    shorthand, batch_form = runs
    assert batch_form.train_step.traces == 1 and batch_form.val_loss == shorthand.val_loss
    for a, b in zip(jax.tree_util.tree_leaves(shorthand.model),
                    jax.tree_util.tree_leaves(batch_form.model)):
        np.testing.assert_array_equal(a, b)


def test_cli_reports_the_wall_time_to_each_validation_loss_and_to_a_target(capsys):
    out = train.main(["--limit", "60", "--epochs", "2", "--hidden", "4", "--embed", "4",
                      "--cap", "32", "--buckets", "fixed:32", "--samples", "0", "--no-cache",
                      "--no-progress", "--target-loss", "100"])
    text = " ".join(capsys.readouterr().out.split())     # rich wraps long lines
    epochs = [r for r in out["history"] if r["kind"] == "epoch"]
    assert len(epochs) == 2 and 0 < epochs[0]["elapsed"] < epochs[1]["elapsed"]
    times = re.search(r"validation loss by wall time: ([\d.]+) at ([\d.]+) s, ([\d.]+) at "
                      r"([\d.]+) s \| 100\.0000 first reached at ([\d.]+) s", text)
    assert times, text
    loss1, at1, loss2, at2, reached = map(float, times.groups())
    assert (loss1, loss2) == tuple(round(r["val_loss"], 4) for r in epochs)
    wall = float(re.search(r"\| wall ([\d.]+) s", text).group(1))
    # Each time counts from the command's start, fit's own setup included (printed to 0.1 s);
    # the first epoch already reaches a loss of 100 nats.
    assert round(epochs[0]["elapsed"], 1) <= at1 <= at2 <= wall and reached == at1


def test_time_to_loss_leaves_out_epochs_restored_from_a_checkpoint():
    history = [{"kind": "epoch", "epoch": 0, "val_loss": 2.5, "elapsed": 40.0},   # restored
               {"kind": "step", "epoch": 1},
               {"kind": "epoch", "epoch": 1, "val_loss": 2.0, "elapsed": 30.0}]
    assert train.time_to_loss(history, 2.0, 1.0) == (
        "validation loss by wall time: 2.0000 at 32.0 s | 1.0000 not reached in the 1 "
        "epoch(s) run here")
    assert train.time_to_loss(history, 2.0, None) == "validation loss by wall time: 2.0000 at 32.0 s"
