"""Flax models through polyexec, as a Flax user writes them: NNX modules (with the typed PRNG
keys their layers keep in state) and linen modules through ``apply``, padded and packed,
values and gradients against each example alone; dropout layout-invariant; verdicts at the
user's line, never inside Flax."""

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import polyexec as px

nnx = pytest.importorskip("flax.nnx")

T, B = px.LengthVar("T", min=1, max=64), px.LengthVar("B", max=8)
SPECS = (None, px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
LENGTHS = [5, 1, 9, 3]


class Tagger(nnx.Module):
    """nnx.RNN as constructed (it holds a typed key), dropout, a head per token."""

    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.GRUCell(3, 4, rngs=rngs))
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(self.rnn(x)))


def _batch():
    rng = np.random.default_rng(0)
    x = np.full((len(LENGTHS), max(LENGTHS), 3), np.nan, np.float32)   # NaN: padding read shows
    for b, n in enumerate(LENGTHS):
        x[b, :n] = rng.normal(size=(n, 3))
    return x, np.asarray(LENGTHS, np.int32)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_an_nnx_model_gives_each_example_its_own_values_and_gradients(layout):
    model = Tagger(nnx.Rngs(0, dropout=1))
    model.eval()
    # NNX's own transform: it threads the RNN's key count through the trace.
    value_and_grad = nnx.value_and_grad(lambda model, x: jnp.sum(jnp.sin(model(x))))
    f = px.bucketed(lambda model, x, lengths: value_and_grad(model, x), SPECS,
                    buckets={T: [16, 64]}, layout=layout, strict=True)
    x, lengths = _batch()
    value, grad = f(model, x, lengths)
    assert f.plan.padding_safe and f.plan.can_pack == (layout == "pack")
    exact = nnx.jit(value_and_grad)        # one program a length, not op by op
    alone = [exact(model, x[b:b + 1, :n]) for b, n in enumerate(LENGTHS)]
    np.testing.assert_allclose(value, sum(v for v, _ in alone), rtol=1e-5)
    want = jax.tree.map(lambda *g: sum(g), *[g for _, g in alone])
    for have, w in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
        np.testing.assert_allclose(have, w, rtol=1e-4, atol=1e-6)


def test_nnx_dropout_draws_the_same_mask_in_every_bucket_and_layout():
    model = Tagger(nnx.Rngs(0, dropout=1))
    model.train()
    x, lengths = _batch()
    outs = {}
    for buckets in ([16, 64], [64]):
        f = px.bucketed(lambda model, x, lengths: model(x), SPECS, buckets={T: buckets})
        outs[len(buckets)] = np.asarray(f(model, x, lengths))
        assert f.plan.padding_safe, f.plan.padding_reason
    # Packed rows draw each cell by its sequence's index in the call and its position: the
    # same mask as padded, without a warning.
    packed = f.with_layout("pack")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs["pack"] = np.asarray(packed(model, x, lengths))
    assert packed.plan.can_pack, packed.plan.packing_reason
    first = outs[2]
    assert not np.isnan(first[np.arange(first.shape[1]) < lengths[:, None]]).any()
    for key, out in outs.items():
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(out[b, :n], first[b, :n], atol=1e-5, err_msg=str(key))
    kept = np.mean([np.asarray(model.drop(jnp.ones(1000))) != 0])   # the layer's own keep rate
    assert 0.4 < kept < 0.6


@pytest.mark.parametrize("layer, packs", [
    # Dropout shared along T draws one (B, 1, F) mask per sequence: the same draw packed.
    (lambda: nnx.Dropout(0.5, broadcast_dims=(1,), rngs=nnx.Rngs(dropout=1)), True),
    # A stride has no room at a sequence that starts mid-row: runs padded, the line named.
    (lambda: nnx.Conv(3, 3, kernel_size=(3,), strides=(2,), rngs=nnx.Rngs(0)), False),
], ids=["dropout shared along T", "strided conv"])
def test_nnx_layers_in_packed_rows_match_padded_or_name_the_users_line(layer, packs):
    """An NNX layer in packed rows gives the padded result: packed, or run padded with one
    warning whose verdict names this file's line (the operation is made inside Flax)."""
    layer = layer()
    x, lengths = _batch()
    padded = px.bucketed(lambda layer, x, lengths: layer(x), SPECS, buckets={T: [16]})
    want = np.asarray(padded(layer, x, lengths))
    packed = padded.with_layout("pack")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = np.asarray(packed(layer, x, lengths))
    assert packed.plan.can_pack == packs, packed.plan.packing_reason
    if not packs:
        assert [str(w.message) for w in caught if "cannot run packed rows" in str(w.message)]
        assert os.path.basename(__file__) in packed.plan.packing_reason
        assert "site-packages" not in packed.plan.packing_reason
    for b, n in enumerate(LENGTHS):
        m = n if packs else -(-n // 2)               # a stride's output: ceil(n / 2) positions
        np.testing.assert_array_equal(got[b, :m], want[b, :m])


def test_the_docs_flax_blocks_run_as_pasted(capsys):
    """The Flax section of the bucketed-functions guide (NNX with dropout, linen packed):
    tests/test_docs.py runs the whole page; this keeps the Flax claims explicit."""
    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "guides",
                        "bucketed-functions.md")
    text = open(page, encoding="utf-8").read()
    section = text[text.index("## Flax models"):]
    setup = ("import jax, jax.numpy as jnp, numpy as np\nimport polyexec as px\n"
             "T, B = px.LengthVar('T', min=1, max=64), px.LengthVar('B', max=8)\n")
    session: dict = {}
    for block in [setup] + re.findall(r"```python\n(.*?)```", section, re.S)[:2]:
        exec(compile(block, page, "exec"), session)
    assert capsys.readouterr().out.split()[-3:] == ["True", "True", "True"]


class CharLM(nnx.Module):
    """An NNX next-token model as constructed: nnx.RNN keeps a typed key in its state."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(9, 4, rngs=rngs)
        self.rnn = nnx.RNN(nnx.GRUCell(4, 4, rngs=rngs))
        self.head = nnx.Linear(4, 9, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.rnn(self.embed(tokens)))


def _next_token_loss(model, tokens, lengths):       # unmasked: the rewrite keeps padding out
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit     # the reference, one sentence at its own length: one program a length, not op by op
def _pair_losses(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)[0]


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_fit_trains_an_nnx_model_on_each_batchs_exact_loss(layout):
    """`fit` takes an NNX module as it is. With a zero learning rate every step's loss must be
    its batch's exact one: the mean over the batch's real next-token pairs, each sentence run
    alone at its own length."""
    from polyexec import training
    import buckets

    rng = np.random.default_rng(3)
    data = [rng.integers(1, 9, n).astype(np.int32) for n in rng.integers(2, 12, 12)]
    model = CharLM(nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = training.fit(model, _next_token_loss, data, optimizer=optax.sgd(0.0), epochs=1,
                              batch_size=4, layout=layout, cache=False, verbose=False)
    # The RNN's key is in the donated state: no donation of it that XLA cannot use.
    assert not [w for w in caught if "donated buffers" in str(w.message)], \
        [str(w.message) for w in caught]
    assert result.layout == layout and result.train_step.traces == 1
    steps = [r for r in result.history if r["kind"] == "step"]
    lengths = np.array([len(d) for d in data])
    if layout == "pack":
        row_lengths, rows = result.policy.sizes, steps[0]["bucket"][0]
        plan = buckets.packed_batch_plan(lengths, list(row_lengths), rows=rows, seed=0)
    else:
        plan = buckets.batch_plan(lengths, result.policy, batch_size=4, seed=0)
    assert [r["tokens"] for r in steps] == [int(lengths[b.indices].sum()) for b in plan]
    for step, batch in zip(steps, plan):
        pairs = [_pair_losses(model, data[i][None, :-1], data[i][None, 1:])
                 for i in batch.indices]
        want = float(jnp.concatenate(pairs).mean())
        np.testing.assert_allclose(step["loss"], want, rtol=1e-5)


# -- a model's state through `fit`: as nnx.jit with nnx.Optimizer carries it --------------------


class Masked(nnx.Module):
    """Issue 49's model: 16 weights seen through a dropout mask, so a weight moves only at the
    steps whose mask keeps it."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros(16))
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def _masked_loss(model, batch):     # the batch's mean (over real cells only) as the target
    return (model.drop(jnp.ones(16)) @ model.w - jnp.mean(batch["x"])) ** 2


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def _normed_loss(model, batch):     # BatchNorm over (B, T): statistics of the real tokens
    return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)


def _fit_steps(result, lengths, batch_size):
    """The batches `fit` ran, in order (the plan it made from the seed, as the run did)."""
    import buckets

    steps = [r for r in result.history if r["kind"] == "step"]
    if result.layout == "pack":
        plan = [b for e in range(len(result.epochs())) for b in buckets.packed_batch_plan(
            lengths, list(result.policy.sizes), rows=steps[0]["bucket"][0], seed=0, epoch=e)]
    else:
        plan = [b for e in range(len(result.epochs())) for b in buckets.batch_plan(
            lengths, result.policy, batch_size=batch_size, seed=0, epoch=e)]
    assert [r["tokens"] for r in steps] == [int(lengths[b.indices].sum()) for b in plan]
    return steps, plan


def _nnx_jit_loop(model, loss, data, plan, optimizer):
    """The reference: nnx.jit + nnx.Optimizer on each batch's real cells alone (the examples
    of a batch concatenated into one row: no padding anywhere)."""
    opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        opt.update(model, grads)
        return value

    return [float(step(model, opt, {"x": np.concatenate([data[i]["x"] for i in b.indices])[None]}))
            for b in plan]


def test_fit_advances_an_nnx_dropout_rng_count_each_step_as_nnx_jit_does():
    from polyexec import training

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 8, 12)
    data = [{"x": rng.normal(size=n).astype(np.float32)} for n in lengths]
    weights = []                     # w after each step: a weight moves where its mask kept it

    def keep(info):
        weights.append(np.array(info.state.model.w[...]))

    result = training.fit(Masked(nnx.Rngs(0, dropout=1)), _masked_loss, data,
                          optimizer=optax.sgd(0.05), batch_size=2, buckets=[8], verbose=False,
                          cache=False, callbacks=[keep])
    steps, plan = _fit_steps(result, lengths, 2)
    assert len(steps) == 6
    # Before: the count stayed 0, every step drew the first mask, 9 of 16 weights never moved.
    assert int(result.model.drop.rngs.count[...]) == 6
    moved = np.diff(np.stack([np.zeros(16, np.float32), *weights]), axis=0) != 0
    assert len({m.tobytes() for m in moved}) > 1, "every step drew the same mask"
    reference = Masked(nnx.Rngs(0, dropout=1))
    losses = _nnx_jit_loop(reference, _masked_loss, data, plan, optax.sgd(0.05))
    assert int(reference.drop.rngs.count[...]) == 6
    assert int((np.asarray(result.model.w[...]) == 0).sum()) == \
        int((np.asarray(reference.w[...]) == 0).sum()) == 0
    # The masks are nnx.jit's own (a draw is jax.jit's bit for bit inside px.bucketed); the
    # losses and weights agree to rounding: the reference sums each batch in one row.
    np.testing.assert_allclose([s["loss"] for s in steps], losses, rtol=1e-5)
    np.testing.assert_allclose(result.model.w[...], reference.w[...], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_fit_updates_nnx_batchnorm_statistics_over_real_tokens_as_nnx_jit_does(layout):
    """Running mean and variance move at every step, from the real tokens alone (the data sit
    around 2, the padding at 0: a statistic over padding would be far off), in either layout."""
    from polyexec import training

    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 9, 12)
    data = [{"x": (2 + rng.normal(size=(n, 3))).astype(np.float32)} for n in lengths]
    options = dict(buckets=[8]) if layout == "pad" else dict(layout="pack")
    result = training.fit(Normed(nnx.Rngs(0)), _normed_loss, data, optimizer=optax.sgd(0.1),
                          epochs=2, batch_size=4, verbose=False, cache=False, **options)
    assert result.layout == layout
    steps, plan = _fit_steps(result, lengths, 4)
    reference = Normed(nnx.Rngs(0))
    losses = _nnx_jit_loop(reference, _normed_loss, data, plan, optax.sgd(0.1))
    # Before: model.bn.mean stayed [0, 0, 0] however long fit trained.
    assert np.all(np.abs(np.asarray(result.model.bn.mean[...])) > 0.1)
    np.testing.assert_allclose([s["loss"] for s in steps], losses, rtol=1e-4)
    for name in ("mean", "var"):
        np.testing.assert_allclose(getattr(result.model.bn, name)[...],
                                   getattr(reference.bn, name)[...], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result.model.lin.kernel[...], reference.lin.kernel[...],
                               rtol=1e-4, atol=1e-5)


def test_nnx_state_is_in_the_checkpoint_and_a_resumed_run_continues_it(tmp_path):
    """The RNG count and batch statistics are saved with the weights: a run stopped after 3
    steps and resumed ends where an uninterrupted one does (the same masks, the same stats)."""
    from polyexec import training

    rng = np.random.default_rng(2)
    lengths = rng.integers(2, 8, 12)
    data = [{"x": rng.normal(size=n).astype(np.float32)} for n in lengths]

    def run(**kwargs):
        return training.fit(Masked(nnx.Rngs(0, dropout=1)), _masked_loss, data,
                            optimizer=optax.sgd(0.05), batch_size=2, buckets=[8], verbose=False,
                            cache=False, **kwargs)

    whole = run()
    stopped = run(checkpoint_dir=tmp_path, max_steps=3)
    saved, _ = training.load_checkpoint(stopped.checkpoint, like=stopped.state)
    assert int(saved.model.drop.rngs.count[...]) == int(stopped.model.drop.rngs.count[...]) == 3
    resumed = run(checkpoint_dir=tmp_path)
    assert int(resumed.model.drop.rngs.count[...]) == 6
    np.testing.assert_array_equal(resumed.model.w[...], whole.model.w[...])
