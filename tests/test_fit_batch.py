"""`fit` on any batch (issue 39): examples that are pytrees -- a classifier (a label per
example) and a tagger (a tag per token) -- train as the same loop written by hand with each
example run alone at its exact length, padded and packed; a loss that asks for a key gets the
step's, so a resumed run draws what an uninterrupted one does; and ``masking=False`` adds no
row that a loss masking itself would count."""

import os
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import buckets
import polyexec as px
from conftest import assert_trees_close
from polyexec import training

VOCAB, CLASSES, TAGS, SEED = 7, 3, 4, 5
OPT = optax.adam(3e-2)


class Tiny(eqx.Module):
    """Each position's state reads its prefix (a running sum of embeddings, mixed); a linear
    head. Cheap to compile, and padding would change both losses below without the rewrite."""

    embed: eqx.nn.Embedding
    mix: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, out, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, 4, key=k1)
        self.mix = eqx.nn.Linear(4, 6, key=k2)
        self.head = eqx.nn.Linear(6, out, key=k3)

    def states(self, tokens):                       # (T,) -> (T, 6)
        return jnp.tanh(jax.vmap(self.mix)(jnp.cumsum(jax.vmap(self.embed)(tokens), 0)))


def classify(model, tokens):                        # one example or a batch: (..., T)
    pooled = jnp.mean(jnp.vectorize(model.states, signature="(t)->(t,h)")(tokens), -2)
    return jnp.vectorize(model.head, signature="(h)->(c)")(pooled)


def tag(model, tokens):
    hs = jnp.vectorize(model.states, signature="(t)->(t,h)")(tokens)
    return jnp.vectorize(model.head, signature="(h)->(c)")(hs)


# The losses fit trains, written on the batch: plain code, no mask, no lengths.
def classifier_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        classify(model, batch["tokens"]), batch["label"]).mean()


def tagger_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        tag(model, batch["tokens"]), batch["tags"]).mean()


# The same, per example at its exact length: (summed loss, terms).
def classifier_example(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(
        classify(model, ex["tokens"]), ex["label"]), 1


def tagger_example(model, ex):
    return optax.softmax_cross_entropy_with_integer_labels(
        tag(model, ex["tokens"]), ex["tags"]).sum(), ex["tokens"].shape[0]


def dataset(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    # Four lengths, ragged in every batch: the reference compiles once per length.
    for length in rng.choice([1, 4, 7, 12], size=n):
        tokens = rng.integers(0, VOCAB, size=length).astype(np.int32)
        out.append({"tokens": tokens, "label": np.int32(tokens.sum() % CLASSES),
                    "tags": (tokens % TAGS).astype(np.int32)})
    return out


DATA = dataset(14, seed=0)
LENGTHS = np.array([len(ex["tokens"]) for ex in DATA])


def by_hand(model, data, batches, example_loss):
    """The reference loop: each step's loss is its examples' summed losses over their terms,
    each example computed alone at its exact length (and its gradient so); adam on the same
    batches in order."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    alone = jax.jit(jax.value_and_grad(
        lambda p, ex: example_loss(eqx.combine(p, static), ex), has_aux=True))
    opt_state, losses = OPT.init(params), []
    for idx in batches:
        results = [alone(params, data[i]) for i in idx]
        count = sum(int(c) for (_, c), _ in results)
        value = sum(float(v) for (v, _), _ in results) / count
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / count, *(g for _, g in results))
        updates, opt_state = OPT.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(value)
    return eqx.combine(params, static), losses


def batches_of(result, layout):
    """The batches fit ran, in order: its batch plan rebuilt from the run's choice."""
    steps = [r for r in result.history if r["kind"] == "step"]
    if layout == "pack":            # the rows a step that hold about batch_size=4 examples
        row_lengths, rows = result.policy.sizes, steps[0]["bucket"][0]
        plan = buckets.packed_batch_plan(np.maximum(LENGTHS, 2), list(row_lengths),
                                         max_tokens=rows * max(row_lengths), seed=SEED, epoch=0)
    else:
        plan = buckets.batch_plan(LENGTHS, result.policy, batch_size=4, seed=SEED, epoch=0)
    # The rebuilt plan is the run's: each step trained exactly its examples' tokens.
    assert [r["tokens"] for r in steps] == [int(LENGTHS[b.indices].sum()) for b in plan]
    return [b.indices for b in plan], [r["loss"] for r in steps]


@pytest.mark.parametrize("layout", ["pad", "pack"])
@pytest.mark.parametrize("fields, loss, example_loss", [
    (("tokens", "label"), classifier_loss, classifier_example),
    (("tokens", "tags"), tagger_loss, tagger_example),
], ids=["classifier", "tagger"])
def test_fit_trains_a_pytree_batch_as_the_exact_loop_by_hand(layout, fields, loss,
                                                             example_loss):
    data = [{k: ex[k] for k in fields} for ex in DATA]
    model = Tiny(CLASSES if "label" in fields else TAGS, jax.random.PRNGKey(1))
    options = dict(buckets=[12]) if layout == "pad" else dict(layout="pack")
    result = training.fit(model, loss, data, optimizer=OPT, batch_size=4, seed=SEED,
                          verbose=False, cache=False, **options)
    assert result.layout == layout and result.train_step.traces == 1
    batches, losses = batches_of(result, layout)
    want_model, want_losses = by_hand(model, data, batches, example_loss)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(eqx.filter(result.model, eqx.is_array),
                       eqx.filter(want_model, eqx.is_array), rtol=1e-4, atol=1e-5)
    # ... and it trained: the parameters moved.
    assert not np.allclose(result.model.head.weight, model.head.weight, atol=1e-3)


class WithMLP(eqx.Module):
    """`Tiny` with an ``eqx.nn.MLP`` head, whose activation is a function leaf of the model."""

    tiny: Tiny
    head: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.tiny, self.head = Tiny(1, k1), eqx.nn.MLP(6, TAGS, 8, 1, key=k2)


def mlp_tagger_loss(model, batch):
    logits = jax.vmap(jax.vmap(model.head))(jax.vmap(model.tiny.states)(batch["tokens"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"]).mean()


def mlp_tagger_example(model, ex):
    logits = jax.vmap(model.head)(model.tiny.states(ex["tokens"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, ex["tags"]).sum(), \
        ex["tokens"].shape[0]


def test_fit_trains_a_model_holding_functions_as_the_exact_loop_by_hand():
    """``eqx.nn.MLP`` keeps its activation as a leaf: the model fit returns keeps it, and the
    run is the hand-written exact loop's (it failed before on that leaf as an output)."""
    data = [{k: ex[k] for k in ("tokens", "tags")} for ex in DATA]
    model = WithMLP(jax.random.PRNGKey(2))
    result = training.fit(model, mlp_tagger_loss, data, optimizer=OPT, batch_size=4, seed=SEED,
                          verbose=False, cache=False, buckets=[12])
    assert result.model.head.activation is model.head.activation
    batches, losses = batches_of(result, "pad")
    want_model, want_losses = by_hand(model, data, batches, mlp_tagger_example)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(eqx.filter(result.model, eqx.is_array),
                       eqx.filter(want_model, eqx.is_array), rtol=1e-4, atol=1e-5)


def test_validation_and_eval_fn_take_the_same_batch_and_the_lengths_by_name():
    def per_example_eval(model, batch, lengths):       # a mean over the batch's examples
        losses = optax.softmax_cross_entropy_with_integer_labels(classify(model, batch["tokens"]),
                                                                 batch["label"])
        return jnp.sum(losses), jnp.sum(jnp.ones_like(lengths))

    model = Tiny(CLASSES, jax.random.PRNGKey(1))
    data = [{"tokens": ex["tokens"], "label": ex["label"]} for ex in DATA]
    result = training.fit(model, classifier_loss, data[:8], validation=data[8:],
                          eval_fn=per_example_eval, optimizer=OPT, batch_size=4, buckets=[12],
                          seed=SEED, verbose=False, cache=False)
    want = np.mean([float(classifier_example(result.model, ex)[0]) for ex in data[8:]])
    np.testing.assert_allclose(result.val_loss, want, rtol=1e-5)


def test_a_loss_asking_for_a_key_gets_the_steps_key_from_the_seed():
    """Step s gets fold_in(step_keys(seed)[0], s): the losses, with sgd(0) holding the weight,
    are the weight times each step's uniform draw."""
    data = [{"x": np.ones(n, np.float32)} for n in (3, 5, 4, 6, 2, 7, 3, 5)]

    def loss(model, batch, key):
        return jnp.mean(batch["x"]) * model.weight[0, 0] * jax.random.uniform(key)

    model = eqx.nn.Linear(1, 1, use_bias=False, key=jax.random.PRNGKey(0))
    result = training.fit(model, loss, data, optimizer=optax.sgd(0.0), batch_size=2,
                          buckets=[8], seed=SEED, verbose=False, cache=False)
    losses = [r["loss"] for r in result.history if r["kind"] == "step"]
    train, _ = training.step_keys(SEED)
    w = float(model.weight[0, 0])
    np.testing.assert_allclose(
        losses, [w * float(jax.random.uniform(jax.random.fold_in(train, s)))
                 for s in range(len(losses))], rtol=1e-6)
    assert len(set(losses)) == len(losses) == 4


def dropout_loss(model, batch, lengths, key):
    """A tagger with dropout on its states, keyed by the step (and the lengths by name)."""
    hs = jax.vmap(model.states)(batch["tokens"])
    keep = jax.random.bernoulli(key, 0.7, hs.shape)
    logits = jax.vmap(jax.vmap(model.head))(jnp.where(keep, hs / 0.7, 0.0))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"]).mean()


def test_a_resumed_run_draws_the_keys_of_an_uninterrupted_one(tmp_path):
    data = [{"tokens": ex["tokens"], "tags": ex["tags"]} for ex in DATA]
    # One persistent compile cache: the second and third runs load the first's programs.
    args = dict(optimizer=OPT, epochs=2, batch_size=4, buckets=[12], seed=SEED, verbose=False,
                cache=str(tmp_path / "xla"))
    model = Tiny(TAGS, jax.random.PRNGKey(2))
    try:
        whole = training.fit(model, dropout_loss, data, **args)
        part = training.fit(model, dropout_loss, data, checkpoint_dir=tmp_path / "ckpt",
                            max_steps=3, **args)
        rest = training.fit(model, dropout_loss, data, checkpoint_dir=tmp_path / "ckpt", **args)
    finally:
        px.disable_persistent_cache()   # process-wide JAX config: leave it as other tests expect
    assert part.stopped_early and int(rest.state.step) == int(whole.state.step) == 8
    assert_trees_close(rest.model, whole.model, rtol=0, atol=0)


# -- masking=False adds no row ------------------------------------------------------------------

def per_example_mean(x, lengths):
    """Masked by hand: each row's mean over its own length, then the mean over the rows."""
    mask = jnp.arange(x.shape[1]) < lengths[:, None]
    return jnp.mean(jnp.sum(jnp.where(mask, x, 0.0), 1) / jnp.maximum(lengths, 1))


def test_masking_false_runs_the_rows_at_their_own_number():
    T, B = px.LengthVar("T", max=16), px.LengthVar("B", max=4)
    f = px.bucketed(per_example_mean, in_specs=(px.Spec("B T", jnp.float32),
                                                px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [16], B: [4]}, masking=False)
    x, lengths = np.ones((3, 5), np.float32), np.array([5, 2, 3], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # masking=False: not padding-safe, as said
        got = float(f(x, lengths))
        at_least = float(f.call_at_least({"B": 4}, x, lengths))
    assert got == at_least == float(per_example_mean(x, lengths)) == 1.0   # was 0.75
    assert sorted(f.stats.buckets) == [(("B", 3), ("T", 16))]


def test_fit_masking_false_trains_a_partial_batch_on_its_own_rows():
    data = [{"x": np.full(n, 2.0, np.float32)} for n in (3, 7, 2, 8, 5, 6, 2, 4, 8, 3)]

    def loss(model, batch, lengths):
        return per_example_mean(batch["x"], lengths) * model.weight[0, 0]

    model = eqx.nn.Linear(1, 1, use_bias=False, key=jax.random.PRNGKey(0))
    result = training.fit(model, loss, data, optimizer=optax.sgd(0.0), batch_size=4, buckets=[8],
                          masking=False, verbose=False, cache=False)
    steps = [r for r in result.history if r["kind"] == "step"]
    assert sorted(r["bucket"][0] for r in steps) == [2, 4, 4]       # 4 + 4 + 2 examples
    np.testing.assert_allclose([r["loss"] for r in steps], [2 * float(model.weight[0, 0])] * 3,
                               rtol=1e-6)


# -- bad input is named before anything compiles ------------------------------------------------

def _never_traced(model, batch):
    raise AssertionError("traced: the bad input was not refused first")


@pytest.mark.parametrize("data, kwargs, message", [
    ([{"x": np.ones(3)}, {"x": np.ones(3)}], {},
     "fit: data: expected a field whose first axis is the example's length"),
    ([{"x": np.ones(3), "y": np.ones(4)}, {"x": np.ones(5), "y": np.ones(6)}],
     {"specs": {"x": px.Spec("T"), "y": px.Spec("T")}},
     r"fit: data\[0\]\['y'\].shape\[0\] = 4 disagrees with fit: data\[0\]\['x'\].shape\[0\] = 3"),
    ([{"x": np.ones(3)}, (np.ones(3),)], {}, r"fit: data\[1\]: expected an example of the "
                                              r"structure of the first"),
    ([{"x": np.ones(3), "n": np.int32(1)}, {"x": np.ones(5), "n": np.int32(2)}],
     {"specs": {"x": px.Spec("B T")}}, r"fit: specs\['x'\]: expected dims naming the "
                                       r"example's lengths .* without the batch axis B"),
    ([np.arange(3), np.arange(4)], {"specs": px.Spec("T")},
     "fit: specs: expected None for examples that are 1-D token arrays"),
])
def test_bad_examples_and_specs_are_named(data, kwargs, message):
    with pytest.raises(px.OptionError, match=message):
        training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), _never_traced, data,
                     optimizer=OPT, verbose=False, cache=False, **kwargs)


def test_a_loss_requiring_an_argument_fit_does_not_give_is_named():
    def loss(model, batch, rng):
        return 0.0

    with pytest.raises(px.OptionError, match=r"fit: loss_fn: expected a callable \(model, batch\) "
                                             r"with optional parameters named lengths, key and "
                                             r"state, "
                                             r"received one that also requires 'rng'"):
        training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), loss,
                     [{"x": np.ones(3)}, {"x": np.ones(4)}], optimizer=OPT, verbose=False)


def test_declared_specs_name_the_length_and_pack_refuses_a_pairwise_field():
    data = [{"x": np.ones((n, n), np.float32), "w": np.ones(3, np.float32)} for n in (2, 3, 4)]
    form = training.as_examples(data, "data", {"x": px.Spec("T T")}).form
    assert [(f.path, f.dims) for f in form.fields] == [("['w']", (3,)), ("['x']", ("T", "T"))]
    assert not form.can_pack
    with pytest.raises(px.OptionError, match=r"fit: layout: 'pack' needs fields with at most one "
                                             r"length axis"):
        training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), _never_traced, data,
                     specs={"x": px.Spec("T T")}, layout="pack", optimizer=OPT, verbose=False)


# -- a non-finite loss or gradient (issue 49) ---------------------------------------------------


def _regression(model, batch):          # per-cell regression: a NaN input makes the loss NaN
    return jnp.mean((jax.vmap(jax.vmap(model))(batch["x"][..., None])[..., 0] - 1.0) ** 2)


def _regression_data(bad: int | None = 9):
    rng = np.random.default_rng(4)
    data = [{"x": rng.normal(size=n).astype(np.float32)} for n in rng.integers(2, 9, 16)]
    if bad is not None:
        data[bad]["x"][1] = np.nan
    return data


def _bad_step(data, bad, batch_size=4):
    """The 1-based step of the run whose batch holds ``data[bad]``, and that batch."""
    lengths = np.array([len(d["x"]) for d in data])
    plan = buckets.batch_plan(lengths, buckets.Fixed([8]), batch_size=batch_size, seed=0)
    return next((s + 1, b) for s, b in enumerate(plan) if bad in b.indices)


def _linear():
    return eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0))


def test_a_nan_input_stops_fit_naming_the_step_epoch_and_examples_and_saves_nothing_after(
        tmp_path):
    data = _regression_data(bad=9)
    step, batch = _bad_step(data, 9)
    assert step > 1                        # a good step and its checkpoint come first
    with pytest.raises(training.NonFiniteError) as caught:
        training.fit(_linear(), _regression, data, optimizer=optax.sgd(0.1), epochs=2,
                     batch_size=4, buckets=[8], checkpoint_dir=tmp_path, checkpoint_every=1,
                     verbose=False, cache=False)
    e = caught.value
    assert isinstance(e, px.PolyexecError) and (e.step, e.epoch) == (step, 0)
    assert e.indices == [int(i) for i in batch.indices] and 9 in e.indices
    assert f"step {step} (epoch 0" in str(e) and "loss nan" in str(e)
    assert f"data[i] for i in [{', '.join(map(str, e.indices))}]" in str(e)
    assert "on_nonfinite='skip'" in str(e)
    # Before: fit trained on, NaN weights checkpointed at every later step, and returned.
    saved = training.list_checkpoints(tmp_path)
    assert [os.path.basename(p) for p in saved][-1] == f"step-{step - 1:09d}.ckpt"
    assert e.checkpoint == saved[-1] and saved[-1] in str(e)
    state, _ = training.load_checkpoint(saved[-1], like=training.TrainState.create(
        _linear(), optax.sgd(0.1)))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state))


def test_a_non_finite_gradient_of_a_finite_loss_stops_fit_too():
    def loss(model, batch):                # sqrt at 0: the value 0, its gradient inf * 0 = nan
        return _regression(model, batch) + jnp.sqrt(jnp.sum(model.weight) * 0.0)

    with pytest.raises(training.NonFiniteError, match=r"received the gradient not finite at "
                       r"step 1 \(epoch 0.*gradient norm nan"):
        training.fit(_linear(), loss, _regression_data(bad=None), optimizer=optax.sgd(0.1),
                     batch_size=4, buckets=[8], verbose=False, cache=False)


def test_on_nonfinite_skip_leaves_the_state_of_a_bad_step_unchanged_and_trains_on():
    data = _regression_data(bad=9)
    step, _ = _bad_step(data, 9)
    weights = []
    result = training.fit(_linear(), _regression, data, optimizer=optax.adam(0.1),
                          batch_size=4, buckets=[8], verbose=False, cache=False,
                          on_nonfinite="skip",
                          callbacks=[lambda info: weights.append(
                              jax.tree_util.tree_map(np.array, (info.state.model,
                                                                info.state.opt_state)))])
    steps = [r for r in result.history if r["kind"] == "step"]
    assert [r.get("skipped", False) for r in steps] == [s + 1 == step for s in range(4)]
    # The skipped step applied nothing: parameters and Adam's moments are the step before's.
    assert step > 1
    assert_trees_close(weights[step - 1], weights[step - 2], rtol=0, atol=0)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(result.state))
    epoch = result.epochs()[0]
    assert epoch["skipped"] == 1 and np.isfinite(epoch["train_loss"])
    good = [r for r in steps if not r.get("skipped")]
    want = sum(r["loss"] * r["tokens"] for r in good) / sum(r["tokens"] for r in good)
    np.testing.assert_allclose(epoch["train_loss"], want, rtol=1e-6)


# -- the loss contract, checked before anything compiles (issue 49) -----------------------------


def _cells(model, batch):
    return (jax.vmap(jax.vmap(model))(batch["x"][..., None])[..., 0] - 1.0) ** 2


@pytest.mark.parametrize("loss, has_aux, message", [
    (lambda m, b: jnp.mean(_cells(m, b), axis=1), False,
     r"fit: loss_fn: expected a scalar floating-point loss \(shape \(\), e\.g\. float32\[\]; "
     r"has_aux=True for a pair \(loss, aux\)\), received an array float32\[2\] on a batch of 2 "
     r"examples of data: reduce it to one number"),
    (lambda m, b: jnp.mean(_cells(m, b)).astype(jnp.int32), False,
     r"fit: loss_fn: expected a scalar floating-point loss .*, received a scalar int32\[\]: a "
     r"gradient needs a floating-point loss"),
    (lambda m, b: (jnp.mean(_cells(m, b)), {"n": jnp.sum(b["x"] > 0)}), False,
     r"fit: loss_fn: expected a scalar floating-point loss .*, received a tuple of 2: "
     r"\(float32\[\], \{'n': int32\[\]\}\); to return \(loss, aux\), pass has_aux=True"),
    (lambda m, b: jnp.mean(_cells(m, b)), True,
     r"fit: loss_fn: expected a pair \(loss, aux\) \(has_aux=True\), received a scalar "
     r"float32\[\]"),
    (lambda m, b: (jnp.mean(_cells(m, b)), {"per_example": jnp.mean(_cells(m, b), 1)}), True,
     r"fit: loss_fn: aux\['per_example'\]: expected a pytree of scalars .*, received an array "
     r"float32\[2\]"),
], ids=["vector", "int", "tuple without has_aux", "has_aux without a pair", "aux not scalar"])
def test_a_loss_breaking_the_contract_is_refused_by_name_before_anything_compiles(
        loss, has_aux, message):
    # Before: a vector loss was "retraced per bucket" at <unknown location>; a tuple or an int
    # got JAX's raw TypeError from inside the train step.
    seen = []

    def recorded(model, batch):
        seen.append(batch["x"].shape)
        return loss(model, batch)

    with pytest.raises(px.OptionError, match=message):
        training.fit(_linear(), recorded, _regression_data(bad=None), optimizer=optax.sgd(0.1),
                     batch_size=4, buckets=[8], verbose=False, cache=False, has_aux=has_aux)
    # Refused from one abstract evaluation on two examples: the step was never traced over
    # symbolic lengths, so nothing of it compiled.
    assert len(seen) == 1 and all(isinstance(d, int) for d in seen[0]), seen


def test_has_aux_logs_each_steps_aux_and_its_epoch_mean_and_trains_as_without():
    data = _regression_data(bad=None)

    def with_aux(model, batch):
        cells = _cells(model, batch)
        return jnp.mean(cells), {"small": jnp.mean(cells < 0.5), "worst": jnp.max(cells)}

    common = dict(optimizer=optax.adam(0.1), batch_size=4, buckets=[8], verbose=False,
                  cache=False, epochs=2, validation=data[:4])
    result = training.fit(_linear(), with_aux, data, has_aux=True, **common)
    plain = training.fit(_linear(), lambda m, b: jnp.mean(_cells(m, b)), data, **common)
    assert_trees_close(result.model, plain.model, rtol=0, atol=0)
    assert result.val_loss == plain.val_loss
    steps = [r for r in result.history if r["kind"] == "step"]
    assert all(set(r["aux"]) == {"small", "worst"} for r in steps)
    for epoch in result.epochs():
        mine = [r for r in steps if r["epoch"] == epoch["epoch"]]
        for name in ("small", "worst"):
            want = sum(r["aux"][name] * r["tokens"] for r in mine) / sum(r["tokens"] for r in mine)
            np.testing.assert_allclose(epoch["aux"][name], want, rtol=1e-6)
    # Over real cells only: a fraction of them, never the padding's (1 - 0)^2 = 1 counted.
    lengths = [len(d["x"]) for d in data]
    assert all(0 <= r["aux"]["small"] <= 1 for r in steps) and max(lengths) > min(lengths)


# -- equinox's functional state (eqx.nn.State) through fit (issue 49) ---------------------------


class Centred(eqx.Module):
    """A layer keeping a running mean of its batch in an eqx.nn.State: the mean over the
    batch's real cells (the padding, 0, would pull it down), updated by every step."""

    lin: eqx.nn.Linear
    index: eqx.nn.StateIndex

    def __init__(self, key):
        self.lin = eqx.nn.Linear(3, 3, key=key)
        self.index = eqx.nn.StateIndex(jnp.zeros(3))

    def __call__(self, x, state):                  # x: (B, T, 3)
        h = jax.vmap(jax.vmap(self.lin))(x)
        mean = jnp.mean(h, axis=(0, 1))
        return h - mean, state.set(self.index, 0.5 * state.get(self.index) + 0.5 * mean)


def _centred_loss(model, batch, state):            # asks for the state by name
    y, state = model(batch["x"], state)
    return jnp.mean((y - batch["x"]) ** 2), state


def test_fit_threads_an_eqx_state_as_a_filter_jit_loop_does(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 9, 12)
    data = [{"x": (2 + rng.normal(size=(n, 3))).astype(np.float32)} for n in lengths]
    result = training.fit(eqx.nn.make_with_state(Centred)(jax.random.PRNGKey(0)), _centred_loss,
                          data, optimizer=optax.sgd(0.1), batch_size=4, epochs=2, buckets=[8],
                          validation=data[:4], verbose=False, cache=False,
                          checkpoint_dir=tmp_path)
    plan = [b for e in range(2) for b in buckets.batch_plan(lengths, result.policy, batch_size=4,
                                                            seed=0, epoch=e)]
    model, state = eqx.nn.make_with_state(Centred)(jax.random.PRNGKey(0))
    opt = optax.sgd(0.1)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state, batch):
        (value, state), grads = eqx.filter_value_and_grad(_centred_loss, has_aux=True)(
            model, batch, state)
        updates, opt_state = opt.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state, value

    losses = []
    for b in plan:       # each batch's real cells alone, as one row: no padding anywhere
        x = np.concatenate([data[i]["x"] for i in b.indices])[None]
        model, state, opt_state, value = step(model, state, opt_state, {"x": x})
        losses.append(float(value))
    np.testing.assert_allclose([r["loss"] for r in result.history if r["kind"] == "step"],
                               losses, rtol=1e-5)
    trained, kept = result.model
    np.testing.assert_allclose(kept.get(trained.index), state.get(model.index), rtol=1e-5)
    assert np.all(np.abs(np.asarray(kept.get(trained.index))) > 0.1)   # it moved
    np.testing.assert_allclose(trained.lin.weight, model.lin.weight, rtol=1e-5)
    assert result.val_loss is not None
    saved, _ = training.load_checkpoint(result.checkpoint, like=result.state)
    np.testing.assert_array_equal(saved.model[1].get(trained.index), kept.get(trained.index))


def test_a_loss_asking_for_state_without_an_eqx_state_is_named():
    with pytest.raises(px.OptionError, match=r"fit: loss_fn: asks for state \(a parameter named "
                       r"state\): expected the model as a \(model, eqx.nn.State\) pair, as "
                       r"eqx.nn.make_with_state returns it, received Centred"):
        training.fit(Centred(jax.random.PRNGKey(0)), _centred_loss, _regression_data(bad=None),
                     optimizer=optax.sgd(0.1), batch_size=4, buckets=[8], verbose=False,
                     cache=False)
