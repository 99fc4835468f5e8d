"""polyexec.training: bucketed steps equal exact-shape steps, resume is exact, data parallel
equals one device, and training lowers the validation loss."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import buckets
import pytest
from hypothesis import given, settings, strategies as st

from conftest import assert_trees_close, run_once
from examples.rnn.model import CharLM, loss_and_count, loss_fn, masked_loss_and_count, masked_loss_fn
import polyexec as px
from polyexec import training
from polyexec.training import _auto as _measuring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model(seed=0, cell="gru"):
    return CharLM(cell=cell, embed=4, hidden=8, key=jax.random.PRNGKey(seed))


def copy_tree(tree):
    """Fresh buffers: a donated state is consumed by the step."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def random_sentences(n, max_len, seed):
    rng = np.random.default_rng(seed)
    # A little structure (a repeated alphabet) so that there is something to learn.
    return [(np.arange(int(k)) + int(rng.integers(0, 5))) % 11 + 97
            for k in rng.integers(2, max_len + 1, size=n)]


# -- bucketed train step == exact-shape train step ---------------------------------------------

OPT = optax.adam(1e-2)
BUCKETED = training.make_train_step(loss_fn, OPT, length_buckets=[8, 16, 24], batch_buckets=[2, 4],
                                    return_grads=True)
# The model's loss has no mask: bucketed, each row is its own length (lengths_of); the
# exact-shape reference is the same loss masked by hand.
EXACT = jax.jit(training.train_step_fn(masked_loss_fn, OPT, return_grads=True))


@settings(max_examples=6)
@given(st.data())
def test_bucketed_train_step_equals_exact_shape_step(data):
    b = data.draw(st.integers(1, 4), label="B")
    t = data.draw(st.sampled_from([3, 9, 17, 24]), label="T")   # pads to 8, 16, 24, 24
    lengths = np.array(data.draw(st.lists(st.integers(0, t), min_size=b, max_size=b)), np.int32)
    lengths[0] = t                                               # the batch's T is real
    seed = data.draw(st.integers(0, 2**16), label="seed")
    tokens = np.random.default_rng(seed).integers(0, 256, size=(b, t)).astype(np.int32)
    state = training.TrainState.create(tiny_model(seed % 7), OPT)

    want_state, want = EXACT(copy_tree(state), tokens, lengths)
    got_state, got = BUCKETED(copy_tree(state), tokens, lengths)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-6)
    assert_trees_close(got["grads"], want["grads"], rtol=1e-4, atol=1e-6)
    assert_trees_close(got_state.model, want_state.model, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state.opt_state, want_state.opt_state, rtol=1e-4, atol=1e-7)
    assert int(got_state.step) == 1
    # One trace for every shape; one compile per (B, T) bucket actually used.
    assert BUCKETED.traces == 1
    assert BUCKETED.stats.compiles == len(BUCKETED.stats.buckets) <= 6


def test_train_step_changes_parameters_and_padding_would_matter():
    """Guards the comparison above: the step moves parameters, and an unmasked loss does see
    the padding once the logical rewrite is off (so equality is not a property of the test)."""
    state = training.TrainState.create(tiny_model(), OPT)
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 9)).astype(np.int32)
    lengths = np.array([9, 9], np.int32)   # every row real: the exact shape is the truth
    new, metrics = EXACT(copy_tree(state), tokens, lengths)
    assert not np.allclose(new.model.head.weight, state.model.head.weight)

    def unmasked(model, tokens, lengths):
        logits = jax.vmap(model)(tokens[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    _, exact = jax.jit(training.train_step_fn(unmasked, OPT))(copy_tree(state), tokens, lengths)
    losses = {}
    for masking in (True, False):
        step = training.make_train_step(unmasked, OPT, length_buckets=[16], batch_buckets=[2],
                                        masking=masking)
        _, padded = step(copy_tree(state), tokens, lengths)
        losses[masking] = float(padded["loss"])
    assert losses[True] == pytest.approx(float(exact["loss"]), rel=1e-5)
    assert abs(losses[False] - float(exact["loss"])) > 1e-4


# -- checkpoints and resume --------------------------------------------------------------------

FIT_ARGS = dict(optimizer=optax.adam(3e-3), epochs=2, batch_size=4, buckets=[8, 16, 24],
                verbose=False, seed=3)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One persistent compile cache for the fits below: a repeated fit of the same model loads
    its buckets from disk instead of compiling them again (the bucket counts do not change)."""
    yield str(tmp_path_factory.mktemp("xla-cache"))
    px.disable_persistent_cache()   # process-wide JAX config: leave it as other tests expect


@pytest.fixture
def fit_args(compile_cache):
    return {**FIT_ARGS, "cache": compile_cache}


class Killed(Exception):
    pass


def kill_at(step):
    def callback(info):
        if info.step == step:
            raise Killed(f"simulated kill after step {step}")
    return callback


def test_resume_after_kill_gives_identical_parameters(tmp_path, fit_args):
    data = random_sentences(26, 24, seed=1)
    val = random_sentences(6, 24, seed=2)
    full = training.fit(tiny_model(), loss_fn, data, validation=val, eval_fn=loss_and_count,
                        **fit_args)
    steps = full.epochs()[-1]["step"]
    assert steps == int(full.state.step) and steps >= 10

    # Killed mid-epoch 1 (second epoch), two steps after the last periodic checkpoint.
    ckpt = tmp_path / "ckpt"
    kill = steps - 3
    with pytest.raises(Killed):
        training.fit(tiny_model(), loss_fn, data, validation=val, eval_fn=loss_and_count,
                     checkpoint_dir=ckpt, checkpoint_every=4, callbacks=[kill_at(kill)], **fit_args)
    latest = training.latest_checkpoint(ckpt)
    meta = training.read_meta(latest)
    assert meta["step"] == kill - kill % 4 and 0 < meta["position"]
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]

    resumed = training.fit(tiny_model(seed=99), loss_fn, data, validation=val,
                           eval_fn=loss_and_count, checkpoint_dir=ckpt, **fit_args)
    assert int(resumed.state.step) == steps
    # Bit-identical: same data order from (seed, epoch, position), same executables.
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state), jax.tree_util.tree_leaves(full.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["val_loss"] for r in resumed.epochs()] == [r["val_loss"] for r in full.epochs()]
    np.testing.assert_allclose([r["train_loss"] for r in resumed.epochs()],
                               [r["train_loss"] for r in full.epochs()], rtol=1e-6)
    # ... and the parameters did move: an untrained model is far from them.
    assert not np.allclose(full.model.head.weight, tiny_model().head.weight, atol=1e-3)


def test_max_steps_stops_and_resumes_to_the_same_result(tmp_path, fit_args):
    data = random_sentences(20, 24, seed=4)
    full = training.fit(tiny_model(), loss_fn, data, **fit_args)
    part = training.fit(tiny_model(), loss_fn, data, checkpoint_dir=tmp_path, max_steps=3,
                        metrics_file=tmp_path / "m.jsonl", **fit_args)
    assert part.stopped_early and int(part.state.step) == 3
    rest = training.fit(tiny_model(), loss_fn, data, checkpoint_dir=tmp_path,
                        metrics_file=tmp_path / "m.jsonl", **fit_args)
    assert_trees_close(rest.model, full.model, rtol=0, atol=0)
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, int(full.state.step) + 1))   # one run, no duplicates
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]


def test_resume_refuses_a_different_run(tmp_path, fit_args):
    data = random_sentences(12, 16, seed=5)
    training.fit(tiny_model(), loss_fn, data, checkpoint_dir=tmp_path, max_steps=1, **fit_args)
    with pytest.raises(px.OptionError, match="seed: checkpoint 3, now 4"):
        training.fit(tiny_model(), loss_fn, data, checkpoint_dir=tmp_path,
                     **{**fit_args, "seed": 4})


def test_checkpoint_roundtrip_and_mismatch(tmp_path):
    state = training.TrainState.create(tiny_model(), OPT)
    path = training.save_checkpoint(tmp_path, state, {"step": 7, "epoch": 1, "position": 2})
    restored, meta = training.load_checkpoint(path, like=state)
    assert meta == {"step": 7, "epoch": 1, "position": 2}
    assert_trees_close(restored, state, rtol=0, atol=0)
    other = training.TrainState.create(CharLM(embed=4, hidden=9, key=jax.random.PRNGKey(0)), OPT)
    with pytest.raises(px.OptionError, match="does not match"):
        training.load_checkpoint(path, like=other)
    for step in range(8, 13):
        training.save_checkpoint(tmp_path, state, {"step": step}, keep=2)
    assert [os.path.basename(p) for p in training.list_checkpoints(tmp_path)] == [
        "step-000000011.ckpt", "step-000000012.ckpt"]


# -- the executor's own accounting, and a compile cache the user configured ----------------------

EFFICIENCY_DATA = random_sentences(22, 24, seed=6)


@pytest.fixture(scope="module")
def fit_in_a_users_cache(tmp_path_factory):
    """One epoch of fit(cache=False) in a process whose user turned JAX's persistent compile
    cache on themselves (the ``jax.config.update`` a user writes)."""
    folder = str(tmp_path_factory.mktemp("users-cache"))
    jax.config.update("jax_compilation_cache_dir", folder)
    try:
        result = training.fit(tiny_model(), loss_fn, EFFICIENCY_DATA, optimizer=OPT, epochs=1,
                              batch_size=4, buckets=[8, 24], cache=False, verbose=False)
        configured = jax.config.jax_compilation_cache_dir
    finally:
        px.disable_persistent_cache()
    return result, folder, configured


def test_epoch_padding_efficiency_is_the_train_steps_own_stats(fit_in_a_users_cache):
    result, _, _ = fit_in_a_users_cache
    (epoch,) = result.epochs()
    stats = result.train_step.stats
    assert epoch["padding_efficiency"] == pytest.approx(stats.padding_efficiency, rel=1e-12)
    # Both are the real tokens over the cells of the (B, T) buckets the steps ran at: fit hands
    # the executor unpadded batches, so it is the executor that counts the padding. (When fit
    # padded batches itself, the executor's column read 1.000.)
    steps = [r for r in result.history if r["kind"] == "step"]
    assert sum(r["tokens"] for r in steps) == sum(map(len, EFFICIENCY_DATA))
    cells = sum(b * t for b, t in (r["bucket"] for r in steps))
    assert stats.padding_efficiency == pytest.approx(epoch["tokens"] / cells, rel=1e-12)
    assert stats.padding_efficiency < 0.9
    ran = {frozenset({("B", b), ("T", t)}) for b, t in (r["bucket"] for r in steps)}
    assert {frozenset(k) for k, b in stats.buckets.items() if b.calls} == ran


def test_cache_false_leaves_a_compile_cache_the_user_configured(fit_in_a_users_cache):
    _, folder, configured = fit_in_a_users_cache
    assert configured == folder


# -- bad input fails before anything compiles --------------------------------------------------

@pytest.mark.parametrize("kwargs, data, message", [
    ({"batch_size": 4, "max_tokens": 64}, None, "expected one of batch_size= or max_tokens="),
    ({"epochs": -1}, None, "fit: epochs: expected an int >= 0, received -1"),
    ({"max_steps": 0}, None, "fit: max_steps: expected an int >= 1 or None, received 0"),
    ({"shuffle": "yes"}, None, "fit: shuffle: expected one of True, False, received 'yes'"),
    ({"masking": 1}, None, "fit: masking: expected one of True, False, received 1"),
    ({"cache": 3}, None, "fit: cache: expected None, True, False or a path, received 3"),
    ({"callbacks": [3]}, None, "fit: callbacks: expected a sequence of callables"),
    ({"buckets": 0}, None, "fit: buckets: expected an int >= 1, received 0"),
    ({"buckets": "8,16"}, None, "fit: buckets: expected 'auto', an int K, a bucket policy or a list of sizes, received str '8,16'"),
        ({"buckets": {8: 16}}, None, "fit: buckets: as_policy: expected a bucket policy"),
    ({"buckets": [4, 8]}, None,
     r"fit: data\[\d+\]: expected a length <= 8 \(the largest bucket of .*\), received length \d+"),
    ({"optimizer": "adam"}, None, "optimizer: expected an optax.GradientTransformation"),
    ({"eval_fn": 3, "validation": [b"abc"]}, None, "fit: eval_fn: expected None or a callable"),
    ({}, "abc", "fit: data: expected a sequence of examples"),
    ({}, [], "fit: data: expected at least one example, received an empty list"),
    ({}, [np.zeros((2, 3), np.int32)], r"data\[0\]: expected a 1-D sequence"),
    ({}, [np.zeros(3, np.float32)], r"data\[0\]: expected integer token ids"),
    ({}, [np.zeros(3, np.int32), []], r"data\[1\]: expected an example of length >= 1, received length 0"),
    ({"devices": 64}, None, r"fit: devices: expected an int from 1 to \d+ .*, received 64"),
    ({"devices": []}, None, "fit: devices: expected None, an int or a non-empty list of devices"),
    ({"progress": 0}, None, "fit: progress: expected one of True, False, received 0"),
    ({"train_on_padding": 1}, None, "fit: train_on_padding: expected one of True, False, "
                                    "received 1"),
    ({"on_nonfinite": "ignore"}, None, "fit: on_nonfinite: expected one of 'stop', 'skip', "
                                       "received 'ignore'"),
    ({"epoch": 2}, None, "fit: expected keyword arguments among optimizer, validation, eval_fn, "
                         "epochs, .*, received unknown 'epoch'"),
])
def test_bad_arguments_are_rejected_with_a_clear_message(kwargs, data, message):
    data = random_sentences(8, 16, seed=0) if data is None else data
    kwargs = {"optimizer": OPT, "cache": False, **kwargs}
    with pytest.raises(px.OptionError, match=message):
        training.fit(tiny_model(), loss_fn, data, verbose=False, **kwargs)


def test_fit_options_are_declared_once():
    """fit's keyword options are FitOptions' fields: its signature shows each with its default."""
    import dataclasses
    import inspect

    params = inspect.signature(training.fit).parameters
    fields = dataclasses.fields(training.FitOptions)
    assert list(params)[:6] == ["model", "loss_fn", "data", "optimizer", "validation", "eval_fn"]
    assert list(params)[6:] == [f.name for f in fields]
    assert all(params[f.name].default == f.default for f in fields
               if f.default is not dataclasses.MISSING)
    assert params["epochs"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(px.OptionError, match="fit: verbose: expected one of True, False, "
                                             "received 'no'"):
        training.FitOptions(verbose="no")


# -- training lowers the validation loss -------------------------------------------------------

def test_short_training_lowers_validation_loss():
    from examples.rnn import data as corpus_data
    corpus = corpus_data.load(cap=128, limit=300)
    model = CharLM(embed=16, hidden=32, key=jax.random.PRNGKey(0))

    # Reference evaluation without polyexec: every validation sentence in one batch padded
    # to the cap, one jit compile.
    tokens = np.zeros((len(corpus.validation), 128), np.int32)
    for r, s in enumerate(corpus.validation):
        tokens[r, :len(s)] = np.frombuffer(s, np.uint8)
    lengths = np.array([len(s) for s in corpus.validation], np.int32)
    reference = jax.jit(masked_loss_and_count)

    def val_loss(m):
        total, count = reference(m, tokens, lengths)
        return float(total) / float(count)

    before = val_loss(model)
    result = training.fit(model, loss_fn, corpus.train, validation=corpus.validation,
                          eval_fn=loss_and_count, optimizer=optax.adam(1e-2), epochs=4,
                          batch_size=16, buckets=3, cache=False, verbose=False)
    after = [r["val_loss"] for r in result.epochs()]
    assert before > 5.0                      # ~ln 256: an untrained byte model
    assert after[-1] < before - 1.5, (before, after)
    assert after[-1] < after[0]
    # fit's exact validation mean (bucketed batches) agrees with the reference evaluation
    np.testing.assert_allclose(after[-1], val_loss(result.model), rtol=1e-4)
    assert result.train_step.traces == 1 and result.train_step.stats.compiles == 3


# -- data parallel on 4 forced CPU devices -----------------------------------------------------

DATA_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, os
    import jax, numpy as np, optax
    assert jax.device_count() == 4, jax.devices()
    from examples.rnn.model import CharLM, loss_fn
    from polyexec import training

    def model():
        return CharLM(embed=4, hidden=8, key=jax.random.PRNGKey(0))

    opt = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(8, 13)).astype(np.int32)
    lengths = np.array([13, 5, 9, 2, 13, 7, 1, 11], np.int32)
    out = {}
    for n in (1, 4):
        dp = training.data_parallel(n)
        step = training.make_train_step(loss_fn, opt, length_buckets=[16], batch_buckets=[8],
                                        shardings=dp.shardings)
        state = training.TrainState.create(model(), opt)
        from polyexec.training._state import place
        state = place(state, dp.replicated)
        losses = []
        for _ in range(3):
            state, metrics = step(state, tokens, lengths)
            losses.append(float(metrics["loss"]))
        out[n] = {"losses": losses, "head": np.asarray(state.model.head.weight).tolist(),
                  "param_devices": len(state.model.head.weight.sharding.device_set),
                  "compiles": step.stats.compiles}
    data = [rng.integers(97, 108, size=k) for k in rng.integers(2, 30, size=40)]
    for n in (1, 4):
        r = training.fit(model(), loss_fn, data, validation=data[:8], optimizer=opt, epochs=2,
                         batch_size=6, buckets=[16, 32], devices=n, cache=False, verbose=False)
        out[f"fit{n}"] = [e["val_loss"] for e in r.epochs()]
        out[f"rows{n}"] = list(r.batch_buckets)

    # Packed rows over 2 devices: 4 rows of 29 a step (max_tokens), 2 whole rows a device.
    import jax.numpy as jnp
    import polyexec as px
    for n in (1, 2):
        r = training.fit(model(), loss_fn, data, validation=data[:8], optimizer=opt, epochs=2,
                         max_tokens=4 * 29, layout="pack", devices=n, cache=False,
                         verbose=False)
        steps = [s for s in r.history if s["kind"] == "step"]
        out[f"pack{n}"] = {
            "layout": r.layout, "losses": [s["loss"] for s in steps],
            "buckets": sorted({tuple(s["bucket"]) for s in steps}),
            "val": [e["val_loss"] for e in r.epochs()],
            "params": [np.asarray(x).ravel().tolist()
                       for x in jax.tree_util.tree_leaves(r.model) if hasattr(x, "shape")]}

    # One call of the executor: 5 sequences (16 + 9 cells) in 2 rows of 16, then one sequence,
    # whose grid is still 2 rows -- one per device, the second empty. Value and gradient equal
    # the exact per-sequence computation.
    T, B = px.LengthVar("T", max=16), px.LengthVar("B", max=64)
    def f(w, x, n):
        return jnp.mean(jnp.sum(jnp.cumsum(jnp.tanh(x * w), 1) ** 2, 1))
    def exact(w, x, n):
        return jnp.mean(jnp.stack([jnp.sum(jnp.cumsum(jnp.tanh(x[i, :k] * w)) ** 2)
                                   for i, k in enumerate(n)]))
    x = rng.normal(size=(5, 9)).astype(np.float32)
    lengths = [9, 3, 4, 2, 7]
    dp = training.data_parallel(2)
    g = px.bucketed(jax.value_and_grad(f), layout="pack", buckets={T: [16], B: [1, 2, 4, 8]},
                    in_specs=(None, px.Spec("B T", jnp.float32),
                              px.Spec("B", jnp.int32, lengths_of=T)),
                    in_shardings=(dp.replicated, dp.batch, dp.batch))
    out["calls"] = []
    for k in (5, 1):
        got = g(np.float32(0.7), x[:k], np.array(lengths[:k], np.int32))
        want = jax.value_and_grad(exact)(np.float32(0.7), x[:k], lengths[:k])
        out["calls"].append([[float(v) for v in got], [float(v) for v in want]])
    out["grids"] = sorted(str(key) for key in g.stats.buckets)
    # Each input of the compiled grid -- the rows, their lengths, the per-cell positions --
    # as one device holds it: half the rows, every column.
    (compiled,) = [c.result().executable for c in g._shared.executables._futures.values()]
    out["shards"] = [list(s.shard_shape(a.shape)) for s, a in
                     zip(compiled.input_shardings[0], compiled.in_avals[0]) if a.shape]

    # Two packed lengths (cross-attention of a target over a source) split over 2 devices:
    # both grids' rows split alike, so each example's parts lie on one device.
    S2, T2, B2 = (px.LengthVar("S", max=16), px.LengthVar("T", max=16),
                  px.LengthVar("B", max=64))
    def cross(src, tgt, n_src, n_tgt):
        w = jax.nn.softmax(jnp.einsum("btf,bsf->bts", tgt, src), axis=-1)
        return jnp.sum((w @ src) ** 2, axis=(1, 2))
    specs = (px.Spec("B S 2", jnp.float32), px.Spec("B T 2", jnp.float32),
             px.Spec("B", jnp.int32, lengths_of=S2), px.Spec("B", jnp.int32, lengths_of=T2))
    args = (rng.normal(size=(5, 9, 2)).astype(np.float32),
            rng.normal(size=(5, 7, 2)).astype(np.float32),
            np.array([9, 3, 4, 2, 7], np.int32), np.array([2, 7, 5, 6, 1], np.int32))
    sizes = {S2: [16], T2: [16], B2: [1, 2, 4, 8]}
    g2 = px.bucketed(cross, specs, layout="pack", buckets=sizes, in_shardings=(dp.batch,) * 4)
    out["cross"] = [np.asarray(g2(*args)).tolist(),
                    np.asarray(px.bucketed(cross, specs, layout="pad", buckets=sizes)(*args)).tolist()]
    (compiled,) = [c.result().executable for c in g2._shared.executables._futures.values()]
    out["cross_shards"] = [[list(s.shard_shape(a.shape)), list(a.shape)] for s, a in
                           zip(compiled.input_shardings[0], compiled.in_avals[0]) if a.shape]

    # layout="auto" on 2 devices prices both layouts at rows the devices split evenly: one
    # row of 64 holds about batch_size=2 of these examples a step, so 2 rows (a cost fixed
    # here, so that the choice does not depend on this machine's speed).
    import buckets, equinox as eqx
    from polyexec.training import _auto
    measured = _auto.measure_cost
    _auto.measure_cost = lambda *a, **k: (measured(*a, **k), buckets.CostModel(1.0, 1e-3))[1]
    sgd = optax.sgd(0.1)
    step = training.make_train_step(
        lambda m, t, n: jnp.mean(t.astype(jnp.float32) * m.weight[0, 0]), sgd,
        length_buckets=[64], batch_buckets=[4], layout="auto", shardings=dp.shardings)
    state = place(training.TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)),
                                             sgd), dp.replicated)
    choice = training.choose_layout(step, state, np.array([3, 5, 6, 7, 40, 41, 64, 9, 2, 12] * 8),
                                    epochs=2, batch_size=2, data_parallel=dp)
    out["auto"] = {"layout": choice.layout, "reason": choice.reason,
                   "pack_rows": choice.pack_rows, "pad_rows": [r for r, _ in choice.pad.shapes]}
    # fit with two lengths (an encoder-decoder), packed over 2 devices and on one.
    import sys
    sys.path.insert(0, "tests")
    from test_fit_several import DATA as PAIRS, OPT as ADAM, Seq2Seq, dataset, loss_fn as s2s
    for n in (1, 2):
        r = training.fit(Seq2Seq(jax.random.PRNGKey(1)), s2s, PAIRS, optimizer=ADAM,
                         batch_size=4, layout="pack", devices=n, cache=False, verbose=False,
                         validation=dataset(5, seed=1))
        steps = [s for s in r.history if s["kind"] == "step"]
        out[f"pairs{n}"] = {"losses": [s["loss"] for s in steps], "val": r.val_loss,
                            "buckets": sorted({tuple(s["bucket"]) for s in steps})}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
    """`DATA_PARALLEL_SCRIPT`'s results, run once in a process with 4 forced CPU devices (once
    per test run: the xdist workers share it, conftest.run_once)."""
    def compute():
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", DATA_PARALLEL_SCRIPT], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
        return json.loads(line[len("RESULT"):])
    return run_once(tmp_path_factory, "four-devices", compute)


def test_data_parallel_on_four_cpu_devices_matches_one_device(four_devices):
    out = four_devices
    one, four = out["1"], out["4"]
    assert four["param_devices"] == 4 and one["param_devices"] == 1
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(four["head"], one["head"], rtol=1e-4, atol=1e-6)
    assert one["losses"][-1] < one["losses"][0]
    # fit: batch rows rounded up to a multiple of the 4 devices; same validation losses.
    assert out["rows1"] == [6] and out["rows4"] == [8]
    np.testing.assert_allclose(out["fit4"], out["fit1"], rtol=1e-4)


def test_packed_fit_on_two_devices_matches_one_device(four_devices):
    """layout="pack" on 2 devices: the same packed steps as on one (4 rows of 29, the same
    global batches), each device 2 whole rows; step losses, validation losses and final
    parameters equal within float reassociation."""
    one, two = four_devices["pack1"], four_devices["pack2"]
    assert one["layout"] == two["layout"] == "pack"
    assert one["buckets"] == two["buckets"] == [[4, 29]]
    assert len(two["losses"]) == len(one["losses"]) > 2
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["val"], one["val"], rtol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    for a, b in zip(two["params"], one["params"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_auto_on_two_devices_prices_both_layouts_at_rows_the_devices_split(four_devices):
    auto = four_devices["auto"]
    assert auto["layout"] == "pack" and auto["pack_rows"] == {"64": 2}     # 1 on one device
    assert "packed" in auto["reason"] and "padded" in auto["reason"], auto["reason"]
    assert auto["pad_rows"] and all(r % 2 == 0 for r in auto["pad_rows"]), auto["pad_rows"]


def test_packed_rows_split_over_two_devices_whole_rows_each(four_devices):
    """The executor rounds a packed grid's rows up to a multiple of the devices (one sequence:
    2 rows, one of them empty) and splits every per-cell input with its rows; the results
    equal the exact per-sequence computation."""
    for got, want in four_devices["calls"]:
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert four_devices["grids"] == ["(('rows(B)', 2), ('row_length(T)', 16))"]
    # The rows (2, 16), their lengths (2, 16), pos and seglen (2, 16): one row a device.
    shards = four_devices["shards"]
    assert shards and all(s == [1, 16] for s in shards), shards


def test_two_packed_lengths_split_over_two_devices_alike(four_devices):
    """Cross-attention packed in two grids on 2 devices: every per-cell input of both grids
    split with its rows (one row a device), the results those of the padded call."""
    got, want = four_devices["cross"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    shards = four_devices["cross_shards"]
    assert shards and all(part[0] * 2 == whole[0] and part[1:] == whole[1:]
                          for part, whole in shards if len(whole) > 1), shards


def test_fit_packs_two_lengths_on_two_devices_as_on_one(four_devices):
    one, two = four_devices["pairs1"], four_devices["pairs2"]
    assert one["buckets"] == two["buckets"] and two["buckets"][0][0] % 2 == 0
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["val"], one["val"], rtol=1e-5)


# -- buckets="auto": the bucket set chosen by predicted cost -------------------------------------

AUTO_DATA = random_sentences(40, 40, seed=8)


@pytest.fixture(scope="module")
def auto_fit(tmp_path_factory):
    """Interrupted after 3 steps with a checkpoint, then resumed: the default buckets="auto"."""
    folder = tmp_path_factory.mktemp("auto")
    # layout="pad": these tests follow the padded bucket choice (packed rows: packed_fit).
    args = dict(optimizer=OPT, epochs=2, batch_size=8, cache=False, verbose=False,
                checkpoint_dir=folder, layout="pad")
    part = training.fit(tiny_model(), loss_fn, AUTO_DATA, max_steps=3, **args)
    rest = training.fit(tiny_model(), loss_fn, AUTO_DATA, **args)
    return part, rest, args


def test_auto_prediction_is_what_the_run_did(auto_fit):
    """The chosen set's predicted steps, cells and shapes are the ones the epochs ran."""
    part, _, _ = auto_fit
    assert isinstance(part.policy, buckets.Auto) and part.prediction is not None
    assert part.train_step.traces == 1
    plan = buckets.batch_plan(np.maximum([len(s) for s in AUTO_DATA], 2), part.policy,
                              batch_size=8, shuffle=False)
    shapes = {(b.rows, b.bucket_size) for b in plan}
    assert set(part.prediction.shapes) == shapes
    assert part.prediction.steps == 2 * len(plan)
    cells = sum(b.rows * b.bucket_size for b in plan)
    assert part.prediction.cells == 2 * cells
    ran = [tuple(r["bucket"]) for r in part.history if r["kind"] == "step"]
    assert set(ran) <= shapes and len(ran) == 3
    # Every shape compiled once, plus at most the one measured at the largest bucket.
    compiled = {tuple(sorted(dict(k).items())) for k, b in part.train_step.stats.buckets.items()
                if b.compiles}
    assert {(("B", r), ("T", t)) for r, t in shapes} <= compiled
    assert len(compiled) <= len(shapes) + 1


def test_auto_resume_keeps_the_checkpoints_choice(auto_fit):
    """A resumed run batches as the interrupted one did (the data order depends on the buckets),
    and its epochs' padding efficiency, rows included, is the predicted one."""
    part, rest, _ = auto_fit
    assert rest.policy.sizes == part.policy.sizes
    assert rest.partial_rows == part.partial_rows
    assert [r["epoch"] for r in rest.epochs()] == [0, 1]
    for record in rest.epochs():
        assert record["padding_efficiency"] == pytest.approx(
            part.prediction.padding_efficiency, rel=1e-12)


def test_auto_refits_when_the_run_is_extended(auto_fit):
    """More epochs than the checkpoint's run planned: the rest is chosen again for them."""
    _, _, args = auto_fit
    longer = training.fit(tiny_model(), loss_fn, AUTO_DATA, **{**args, "epochs": 3})
    assert longer.prediction is not None            # measured and chosen again ...
    assert longer.prediction.steps == len(buckets.batch_plan(
        np.maximum([len(s) for s in AUTO_DATA], 2), longer.policy, batch_size=8))  # ... for 1 epoch
    assert [r["epoch"] for r in longer.epochs()] == [0, 1, 2]


# -- the measurement behind "auto": an outlier sample does not decide ------------------------

SLOW, USUAL, COMPILE = 10.0, 1e-3, 1.0
# The real ones, wrapped afresh by each fake_clock (a second one must not wrap the first).
REAL_TIMED_STEP, REAL_COMPILE_AT = _measuring._timed_step, _measuring.compile_at


def fake_clock(monkeypatch, slow=lambda i: False):
    """`measure_cost`'s clock replaced, so that nothing here depends on this machine's speed:
    each timed call still runs the step (a run may keep its output) but reports ``USUAL``
    seconds, or ``SLOW`` where ``slow(i)`` for the i-th call from 0 (an outlier, such as a
    first call after a compile on a busy machine); each compile reports ``COMPILE``. Returns
    the list the (rows, length) of every timed call is appended to, in order."""
    calls = []

    def timed(step, arg, tokens, lengths):
        _, output = REAL_TIMED_STEP(step, arg, tokens, lengths)
        calls.append(tuple(jax.tree_util.tree_leaves(tokens)[0].shape))
        return (SLOW if slow(len(calls) - 1) else USUAL), output

    def compile_at(steps, shape):
        return COMPILE * len(steps), REAL_COMPILE_AT(steps, shape)[1]

    monkeypatch.setattr(_measuring, "_timed_step", timed)
    monkeypatch.setattr(_measuring, "compile_at", compile_at)
    return calls


def _linear_loss(model, tokens, lengths):
    return jnp.mean(tokens.astype(jnp.float32) * model.weight[0, 0])


# Exact-length padded buckets waste no cell here, packed rows some: dear cells pad, cheap pack.
LAYOUT_LENGTHS = np.array([3, 5, 6, 7, 40, 41, 64, 9, 2, 12] * 8)


@pytest.mark.parametrize("real_batches", [False, True], ids=["padding", "real-batches"])
def test_choose_layout_times_three_calls_and_a_slow_one_does_not_decide(monkeypatch,
                                                                        real_batches):
    """`fit`'s measurement (padding calls) and the benchmark's (the run's first real batches,
    kept): three timed calls at the packed grid, the fastest counting. A first call 10,000x
    the others changes neither the cost nor the layout; every call that slow -- what one
    slow sample would have priced -- changes the layout (so the outlier could have decided)."""
    tokens = np.random.default_rng(0).integers(1, 9, (len(LAYOUT_LENGTHS), 64)).astype(np.int32)

    def examples(indices):
        n = LAYOUT_LENGTHS[indices].astype(np.int32)
        return tokens[indices, :int(n.max())], n

    sgd = optax.sgd(0.1)
    # One step for the three choices: the packed program compiles once (the clock says 1 s).
    step = training.make_train_step(_linear_loss, sgd, length_buckets=[64], batch_buckets=[4],
                                    layout="auto")

    def choose(slow):
        calls = fake_clock(monkeypatch, slow)
        state = training.TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), sgd)
        more = dict(examples=examples, next_arg=lambda out: out[0]) if real_batches else {}
        return training.choose_layout(step, state, LAYOUT_LENGTHS, epochs=2, max_tokens=256,
                                      **more), calls

    usual, calls = choose(lambda i: False)
    assert usual.layout == "pack" and usual.pack_rows == {64: 4}, usual.describe()
    assert len(calls) == _measuring.SAMPLES == 3
    if real_batches:        # every timed call a real batch's step, kept as the run's first
        assert len(usual.first_steps) == 3
    else:
        assert calls == [(4, 64)] * 3 and usual.first_steps == ()
    assert usual.cost.seconds_per_cell == USUAL / (4 * 64)
    first_slow, calls = choose(lambda i: i == 0)
    assert len(calls) == 3
    assert first_slow.cost == usual.cost and first_slow.layout == usual.layout
    assert first_slow.pack == usual.pack and first_slow.pad == usual.pad
    all_slow, _ = choose(lambda i: True)
    assert all_slow.layout == "pad", all_slow.describe()


def test_fit_prices_its_run_by_the_fastest_of_three_calls(monkeypatch):
    """`fit` (layout and buckets "auto") times three padding calls at the packed grid; the
    first, 10,000x the others, is not in its prediction (seconds per cell from the usual
    call), and the run trains packed, as the usual calls price it. Every call that slow
    prices packed rows above padded buckets: the run pads (this used to fail in fit while
    printing the choice: the padded buckets priced by the packed measurement have no
    measurement of their own)."""
    def run(slow):
        calls = fake_clock(monkeypatch, slow)
        # A linear model: the test is about the measurement; a GRU's compiles took seconds.
        model = eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0))
        return training.fit(model, _linear_loss, AUTO_DATA, optimizer=optax.sgd(0.1), epochs=1,
                            batch_size=4, cache=False, verbose=False), calls

    all_slow, _ = run(lambda i: True)
    assert all_slow.layout == "pad" and all_slow.epochs()
    result, calls = run(lambda i: i == 0)
    assert result.layout == "pack"
    (grid,) = set(calls)
    assert len(calls) == _measuring.SAMPLES and grid[1] == max(result.policy.sizes)
    prediction = result.prediction
    assert prediction.compiles == 0
    assert prediction.step_seconds == pytest.approx(prediction.cells * USUAL / (grid[0] * grid[1]))


@pytest.fixture(scope="module")
def packed_fit(tmp_path_factory):
    """layout="pack": interrupted after 3 steps and resumed, and the same run uninterrupted."""
    folder = tmp_path_factory.mktemp("packed")
    args = dict(optimizer=OPT, epochs=2, batch_size=4, cache=False, verbose=False,
                layout="pack", validation=AUTO_DATA[:9], eval_fn=loss_and_count)
    part = training.fit(tiny_model(), loss_fn, AUTO_DATA, max_steps=3, checkpoint_dir=folder,
                        **args)
    rest = training.fit(tiny_model(), loss_fn, AUTO_DATA, checkpoint_dir=folder, **args)
    whole = training.fit(tiny_model(), loss_fn, AUTO_DATA, **args)
    return part, rest, whole


def test_packed_fit_trains_every_example_once_an_epoch_in_the_predicted_rows(packed_fit):
    """``batch_size=4`` keeps its meaning packed: as few rows of the longest bucket as take an
    epoch in no more steps than 4 examples a step would (one row fewer would take more)."""
    _, _, whole = packed_fit
    assert whole.layout == "pack" and whole.train_step.traces == 1
    lengths = np.maximum([len(s) for s in AUTO_DATA], 2)
    (row_length,) = whole.policy.sizes
    steps = [r for r in whole.history if r["kind"] == "step"]
    rows = steps[0]["bucket"][0]
    plans = [buckets.packed_batch_plan(lengths, [row_length], rows=rows, seed=0, epoch=e)
             for e in (0, 1)]
    padded_steps = -(-len(lengths) // 4)
    assert len(plans[0]) <= padded_steps
    if rows > 1:
        fewer = buckets.packed_batch_plan(lengths, [row_length], rows=rows - 1, seed=0)
        assert len(fewer) > padded_steps
    assert [tuple(r["bucket"]) for r in steps] == [(rows, row_length)] * sum(map(len, plans))
    for epoch, plan in enumerate(plans):
        # Several examples a row, each exactly once: the tokens each step trained are its own.
        ran = [r["tokens"] for r in steps if r["epoch"] == epoch]
        assert ran == [int(lengths[b.indices].sum()) for b in plan]
        assert sorted(np.concatenate([b.indices for b in plan])) == list(range(len(AUTO_DATA)))
    assert whole.prediction.steps == len(steps)
    padded = np.ceil(len(lengths) / 4) * 4 * row_length
    assert whole.epochs()[-1]["padding_efficiency"] > lengths.sum() / padded
    assert {k for k, b in whole.train_step.stats.buckets.items() if b.compiles} == \
        {(("rows(B)", rows), ("row_length(T)", row_length))}
    assert np.isfinite(whole.val_loss)


def test_packed_fit_resumes_to_the_same_parameters(packed_fit):
    part, rest, whole = packed_fit
    assert part.stopped_early and part.layout == rest.layout == "pack"
    assert rest.policy.sizes == whole.policy.sizes
    assert_trees_close(rest.model, whole.model, rtol=0, atol=0)
    assert rest.val_loss == whole.val_loss


def test_layout_pack_is_refused_where_it_cannot_run_and_pads_a_loss_that_reads_lengths():
    with pytest.raises(px.OptionError, match=r"fit: layout: 'pack' needs buckets='auto'"):
        training.fit(tiny_model(), loss_fn, AUTO_DATA, optimizer=OPT, buckets=[16, 40],
                     layout="pack", verbose=False)
    with pytest.raises(px.OptionError, match=r"fit: layout: expected one of 'auto', 'pad'"):
        training.fit(tiny_model(), loss_fn, AUTO_DATA, optimizer=OPT, layout="packed")
    # A per-position vector contracted along T into the rows: no packed rule.
    with pytest.warns(UserWarning, match="cannot run packed rows"):
        result = training.fit(tiny_model(), position_weighted_loss, AUTO_DATA, optimizer=OPT,
                              epochs=1, batch_size=8, layout="pack", verbose=False, cache=False)
    assert result.layout == "pad"


def position_weighted_loss(model, tokens, lengths):
    h = jax.vmap(model)(tokens)                                     # (B, T, vocab)
    return jnp.mean(jnp.einsum("btv,t->bv", h, jnp.cos(jnp.arange(h.shape[1]))))


def test_a_loss_masked_by_hand_trains_packed_like_the_unmasked_one():
    # The lengths are a per-sequence input: each packed cell reads its own sequence's.
    args = dict(optimizer=OPT, epochs=1, batch_size=8, layout="pack", verbose=False,
                cache=False)
    masked = training.fit(tiny_model(), masked_loss_fn, AUTO_DATA, **args)
    plain = training.fit(tiny_model(), loss_fn, AUTO_DATA, **args)
    assert masked.layout == plain.layout == "pack"
    assert_trees_close(eqx.filter(masked.model, eqx.is_array),
                       eqx.filter(plain.model, eqx.is_array), rtol=1e-4, atol=1e-6)


def test_a_packed_checkpoint_resumes_only_where_it_can_pack(tmp_path):
    args = dict(optimizer=OPT, epochs=2, batch_size=4, cache=False, verbose=False,
                checkpoint_dir=tmp_path)
    # layout="auto" both times (the option is part of what a checkpoint must match); on these
    # long-tailed lengths packed rows hold far fewer cells, so auto packs.
    part = training.fit(tiny_model(), loss_fn, AUTO_DATA, max_steps=2, **args)
    assert part.layout == "pack" and part.stopped_early
    with pytest.raises(px.OptionError, match="its run trained packed rows, which this one cannot"):
        training.fit(tiny_model(), loss_fn, AUTO_DATA, masking=False, **args)


def test_fit_leaves_the_callers_model_readable():
    """The steps donate the state's buffers; they are fit's own copies, not the caller's."""
    model = tiny_model()
    before = np.asarray(model.head.weight).copy()
    for _ in range(2):
        training.fit(model, loss_fn, AUTO_DATA[:8], optimizer=OPT, batch_size=4, buckets=[40],
                     verbose=False, cache=False)
    np.testing.assert_array_equal(np.asarray(model.head.weight), before)


def test_auto_choice_is_repeated_by_passing_the_policy(auto_fit):
    """``buckets=result.policy`` runs the chosen (length x rows) shapes, partial rows included."""
    part, _, _ = auto_fit
    again = training.fit(tiny_model(), loss_fn, AUTO_DATA, optimizer=OPT, epochs=1, batch_size=8,
                         buckets=part.policy, cache=False, verbose=False, max_steps=40)
    assert again.prediction is None and again.partial_rows == part.partial_rows
    ran = {tuple(r["bucket"]) for r in again.history if r["kind"] == "step"}
    assert ran == set(part.prediction.shapes)


def test_measure_cost_on_a_cache_hit_reports_the_recorded_cost(tmp_path):
    """A program loaded from the persistent cache costs what it cost when compiled, not the
    load's seconds (else a second run would think compiles free and choose other buckets)."""
    px.enable_persistent_cache(str(tmp_path))
    try:
        costs = []
        for _ in range(2):     # two functions, one program: the second loads it from disk
            step = training.make_train_step(loss_fn, OPT, length_buckets=[16], batch_buckets=[2])
            state = training.TrainState.create(tiny_model(), OPT)
            costs.append(training.measure_cost(step, state, np.zeros((2, 16), np.int32),
                                               np.full(2, 16, np.int32)))
            assert step.stats.compiles == 1
    finally:
        px.disable_persistent_cache()
    recorded = json.loads((tmp_path / "polyexec-costs.json").read_text())
    assert list(recorded.values()) == [[costs[0].compile_seconds, costs[0].seconds_per_cell]]
    assert costs[1] == costs[0]        # the same cost, hence the same choice of buckets


def test_measuring_a_step_compiles_the_step_alone():
    """measure_cost's compiles are the step's own, which the run then uses: the copies of the
    state its timed calls run on compiled one program per array shape (jnp.copy)."""
    # Array shapes no other test uses: a copy program compiled earlier in the process would
    # be cached and hide the compile.
    model = CharLM(cell="gru", embed=3, hidden=7, key=jax.random.PRNGKey(5))
    step = training.make_train_step(loss_fn, OPT, length_buckets=[16], batch_buckets=[2])
    state = training.TrainState.create(model, OPT)
    with px.count_compiles() as events:
        training.measure_cost(step, state, np.zeros((2, 16), np.int32), np.full(2, 16, np.int32),
                              runs=2)
    assert step.stats.compiles == 1
    assert events.xla_compiles == 1


def test_choose_buckets_measures_once_and_gives_the_steps_exactly_the_plans_shapes():
    """One function chooses for fit and for the benchmark: measure, Auto.fit, re-bucket."""
    lengths = np.array([len(s) for s in AUTO_DATA])
    step = training.make_train_step(loss_fn, OPT, length_buckets=[60], batch_buckets=[8])
    state = training.TrainState.create(tiny_model(), OPT)
    choice = training.choose_buckets(step, state, lengths, epochs=2, batch_size=8, min_length=2,
                                     validation_lengths=np.array([3, 60]))
    assert choice.cost is not None and choice.measured_at == (8, 60)
    assert step.stats.compiles == 1                 # the measurement, at (8, 60)
    assert choice.policy.sizes[-1] == 60 and choice.policy.largest == 60   # validation's bucket
    plan = buckets.batch_plan(lengths, choice.policy, batch_size=8, shuffle=False)
    assert set(choice.train_shapes) == {(b.rows, b.bucket_size) for b in plan}
    assert choice.steps[0].bucket_sizes("T") == tuple(choice.sizes["T"])
    assert choice.steps[0].bucket_sizes("B") == tuple(choice.sizes["B"])
    # A known choice is re-bucketed as it is: nothing measured, nothing compiled.
    again = training.choose_buckets(step, state, lengths, epochs=2, batch_size=8,
                                    known=buckets.Auto((10, 40)))
    assert again.cost is None and again.policy.sizes == (10, 40) and step.stats.compiles == 1
    assert again.sizes["T"] == [10, 40] and {10, 40} <= set(again.steps[0].bucket_sizes("T"))


# -- bad output paths, learning rates, batch sizes and cost records --------------------------------

def _never_traced(model, tokens, lengths):
    raise AssertionError("the loss was traced: work started before the bad input was refused")


@pytest.mark.parametrize("kwargs, message", [
    ({"checkpoint_dir": "FILE"}, "fit: checkpoint_dir: expected a folder (created if missing), "
                                 "received '{file}' which is a file"),
    ({"cache": "FILE"}, "fit: cache: expected a folder (created if missing), received '{file}' "
                        "which is a file"),
    ({"metrics_file": "DIR"}, "fit: metrics_file: expected a file path, received '{dir}' which "
                              "is a folder"),
    ({"metrics_file": "DIR/missing/m.jsonl"}, "fit: metrics_file: expected a file in an existing "
                                              "folder, received '{dir}/missing/m.jsonl'"),
])
def test_fit_checks_output_paths_before_any_work(kwargs, message, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("x")
    kwargs = {k: v.replace("FILE", str(file)).replace("DIR", str(tmp_path))
              for k, v in kwargs.items()}
    with pytest.raises(px.OptionError) as info:
        training.fit(tiny_model(), _never_traced, random_sentences(8, 16, seed=0), optimizer=OPT,
                     verbose=False, **kwargs)
    assert str(info.value).startswith(message.format(file=file, dir=tmp_path))


@pytest.mark.parametrize("optimizer, message", [
    (optax.adam(float("inf")), "fit: optimizer: expected finite updates (a finite learning rate), "
                               "received an optimizer whose first step for a unit gradient is -inf"),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(float("nan"))),
     "fit: optimizer: expected finite updates (a finite learning rate), received an optimizer "
     "whose first step for a unit gradient is nan"),
    (optax.sgd(-0.1), "fit: optimizer: expected a step against the gradient (a learning rate > 0), "
                      "received an optimizer whose first step for a unit gradient is +0.1"),
])
def test_fit_refuses_a_non_finite_or_negative_learning_rate(optimizer, message):
    with pytest.raises(px.OptionError) as info:
        training.fit(tiny_model(), _never_traced, random_sentences(8, 16, seed=0),
                     optimizer=optimizer, verbose=False, cache=False)
    assert str(info.value).startswith(message)


def test_fit_accepts_a_schedule_that_starts_at_zero():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    result = training.fit(tiny_model(), loss_fn, random_sentences(8, 16, seed=0),
                          optimizer=optax.adam(schedule), batch_size=4, buckets=[16],
                          verbose=False, cache=False)
    assert np.isfinite(result.epochs()[0]["train_loss"])


def test_fit_clamps_a_batch_size_above_the_data_with_a_note():
    import io
    import rich.console

    out = io.StringIO()
    data = random_sentences(6, 16, seed=0)
    result = training.fit(tiny_model(), loss_fn, data, optimizer=OPT, batch_size=100_000,
                          buckets=[16], cache=False, progress=False,
                          console=rich.console.Console(file=out, width=200))
    assert "note: batch_size=100000 is more than the 6 training examples; using batch_size=6" \
        in out.getvalue()
    assert result.batch_buckets == (6,)
    assert {tuple(r["bucket"]) for r in result.history if r["kind"] == "step"} == {(6, 16)}


@pytest.mark.parametrize("damage", ["[1, 2]", "not json {", "a bad entry"])
def test_a_damaged_cost_record_is_ignored_with_a_warning(damage, tmp_path):
    record = tmp_path / "polyexec-costs.json"
    ignored = "measure_cost: ignoring the cost record .*polyexec-costs.json: .*measured again"

    def measure():
        step = training.make_train_step(loss_fn, OPT, length_buckets=[16], batch_buckets=[2])
        state = training.TrainState.create(tiny_model(), OPT)
        return training.measure_cost(step, state, np.zeros((2, 16), np.int32),
                                     np.full(2, 16, np.int32))

    px.enable_persistent_cache(str(tmp_path))
    try:
        if damage == "a bad entry":
            measure()                          # compiles and records a good entry
            damage = json.dumps({next(iter(json.loads(record.read_text()))): "x"})
        else:
            record.write_text(damage)
            with pytest.warns(UserWarning, match=ignored):
                measure()                      # compiles; the record is written anew, whole
            assert isinstance(json.loads(record.read_text()), dict)
        record.write_text(damage)
        with pytest.warns(UserWarning, match=ignored):
            cost = measure()                   # loaded from disk: the record is read
    finally:
        px.disable_persistent_cache()
    assert cost.compile_seconds >= 0 and cost.seconds_per_cell > 0


def test_a_partial_batch_counts_only_its_real_rows():
    """A bucket's last batch holds fewer examples than a full batch's rows. It runs at the full
    batch's (compiled) shape, but the rows it lacks are no rows: a loss that averages a mean
    per example over the rows sees only the real examples, in training and in evaluation.
    (Zero-length filler rows gave a mean of an empty row, NaN, and diluted a mean over rows.)"""
    data = [np.full(n, 5, np.int32) for n in (3, 7, 2, 8, 5, 6, 2, 4, 8, 3)]   # 4 + 4 + 2

    def per_example(model, tokens):
        return jax.vmap(lambda row: jnp.mean(row * model.weight[0, 0]))(tokens)

    def loss(model, tokens, lengths):
        return jnp.mean(per_example(model, tokens))

    def eval_fn(model, tokens, lengths):
        return jnp.sum(per_example(model, tokens)), tokens.shape[0]

    model = eqx.nn.Linear(1, 1, use_bias=False, key=jax.random.PRNGKey(0))
    w = float(model.weight[0, 0])
    result = training.fit(model, loss, data, validation=data, eval_fn=eval_fn,
                          optimizer=optax.sgd(0.0), epochs=1, batch_size=4, buckets=[8],
                          cache=False, verbose=False, progress=False)
    steps = [r for r in result.history if r["kind"] == "step"]
    assert [r["bucket"] for r in steps] == [[4, 8]] * 3                  # one compiled shape
    np.testing.assert_allclose([r["loss"] for r in steps], [5 * w] * 3, rtol=1e-6)
    np.testing.assert_allclose(result.val_loss, 5 * w, rtol=1e-6)
    assert result.train_step.stats.compiles == 1


# -- never on padding: a step padding may change is refused before anything compiles ----------

def solve_weight(tokens):
    """A weight from a triangular solve along T, which has no rule (token dropout, the example
    here before, is padding-safe now: its draws are layout-invariant, tests/test_random.py)."""
    T = tokens.shape[1]
    return jnp.mean(jax.scipy.linalg.solve_triangular(2 * jnp.eye(T), jnp.ones(T), lower=True))


def unsafe_loss(model, tokens, lengths):
    return loss_fn(model, tokens, lengths) * solve_weight(tokens)


def unsafe_eval(model, tokens, lengths):
    loss, count = loss_and_count(model, tokens, lengths)
    return loss * solve_weight(tokens), count


@pytest.fixture
def made_steps(monkeypatch):
    """The steps fit makes (views of them share their stats), to count what they compiled."""
    from polyexec.training import _fit

    made = []

    def spy(make):
        def making(*args, **kwargs):
            made.append(make(*args, **kwargs))
            return made[-1]
        return making

    monkeypatch.setattr(_fit, "make_train_step", spy(_fit.make_train_step))
    monkeypatch.setattr(_fit, "make_eval_step", spy(_fit.make_eval_step))
    return made


def refused(made_steps, loss, **kwargs) -> str:
    """fit's refusal of ``loss``, checked to come before any step ran or any bucket compiled
    (buckets="auto" compiles one to measure it: not even that)."""
    steps = []
    data = random_sentences(8, 16, seed=0)
    with pytest.raises(px.PolymorphismError) as info:
        training.fit(tiny_model(), loss, data, validation=data[:4], optimizer=OPT,
                     callbacks=[steps.append], verbose=False, cache=False, **kwargs)
    assert steps == [] and len(made_steps) == 2
    assert [s.stats.compiles for s in made_steps] == [0, 0]
    return str(info.value)


def skip_ten_loss(model, tokens, lengths):
    """The loss over the tokens after the first ten: JAX cannot decide `T - 10 >= 1` below
    T = 11, further up than polyexec raises a min by itself."""
    logp = jax.nn.log_softmax(jax.vmap(model)(tokens[:, 10:]), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 10:, None], axis=-1).mean()


def test_fit_refuses_a_step_retraced_per_bucket_and_says_which_min_length_to_pass(made_steps):
    """Retraced per bucket, a step runs on the padded batch as written (a next-token loss at
    min_length=1 did, before polyexec traced it at T >= 2, and learned to predict the
    padding)."""
    message = refused(made_steps, skip_ten_loss, min_length=1)
    assert message.startswith("fit: loss_fn: expected a train step traced once for every "
                              "length (shape-polymorphic), received one retraced per bucket")
    assert re.search(r"test_training\.py:\d+ in skip_ten_loss: `return .*tokens\[:, 10:, "
                     r"None\].*`: InconclusiveDimensionOperation: .*'- min\(T, 10\) \+ T' >= "
                     r"'1' is inconclusive; .*; pass min_length=11 ", message), message
    assert message.endswith("or pass train_on_padding=True to train on it anyway")


def test_fit_at_min_length_1_trains_the_next_token_loss_as_at_min_length_2():
    """`tokens[:, 1:]` at min_length=1 is traced at T >= 2 (JAX's rule needs it) and trains
    exactly: the same losses as at min_length=2, without a warning."""
    data = random_sentences(8, 16, seed=0)
    histories = []
    for min_length in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = training.fit(tiny_model(), loss_fn, data, optimizer=OPT,
                                  min_length=min_length, buckets=[16], batch_size=4,
                                  verbose=False, cache=False)
        histories.append([r["loss"] for r in result.history if r["kind"] == "step"])
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)
    assert len(histories[0]) == 2


@pytest.mark.parametrize("loss, eval_fn, start", [
    (unsafe_loss, None, "fit: loss_fn: expected a train step that padding cannot change "
                        "(padding-safe), received one that is not: "),
    (loss_fn, unsafe_eval, "fit: eval_fn: expected an eval step that padding cannot change "
                           "(padding-safe), received one that is not: "),
])
def test_fit_refuses_a_step_that_is_not_padding_safe_naming_the_line(made_steps, loss, eval_fn,
                                                                     start):
    message = refused(made_steps, loss, eval_fn=eval_fn)
    assert message.startswith(start), message
    assert re.search(r"test_training\.py:\d+: `.*solve_triangular\(.*`: triangular_solve: "
                     r"no rule for triangular_solve on a length axis( \(and \d+ more\))?; change "
                     r"that line, or mask the padding by hand and pass masking=False, or pass "
                     r"train_on_padding=True to train on it anyway$", message), message


@pytest.mark.parametrize("loss, min_length, warning", [
    (unsafe_loss, 2, "train_step is not padding-safe, so padding may change its result: "
                     r".*test_training\.py:\d+"),
    (skip_ten_loss, 1, "train_step is not shape-polymorphic, so it is retraced and compiled "
                       r"per bucket, .*'- min\(T, 10\) \+ T' >= '1'"),
])
def test_train_on_padding_trains_the_refused_step_with_a_warning(loss, min_length, warning):
    with pytest.warns(UserWarning, match=warning):
        result = training.fit(tiny_model(), loss, random_sentences(8, 16, seed=0), optimizer=OPT,
                              min_length=min_length, buckets=[16], batch_size=4,
                              train_on_padding=True, verbose=False, cache=False)
    assert len([r for r in result.history if r["kind"] == "step"]) == 2
    assert np.isfinite(result.epochs()[0]["train_loss"])


def test_masking_false_is_never_refused(made_steps):
    """masking=False says the loss masks the padding itself: the step refused with the rewrite
    on (its plan not padding-safe) trains with it off, the plan saying why."""
    refused(made_steps, unsafe_loss)
    result = training.fit(tiny_model(), unsafe_loss, random_sentences(8, 16, seed=0),
                          optimizer=OPT, buckets=[16], batch_size=4, masking=False,
                          verbose=False, cache=False)
    assert np.isfinite(result.epochs()[0]["train_loss"])
    assert result.train_step.plan.padding_reason.startswith("masking=False: ")
