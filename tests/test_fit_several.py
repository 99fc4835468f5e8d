"""`fit` on examples of several lengths (issue 54): an encoder-decoder's ``{"src": (S,),
"tgt": (T,)}`` trains padded (a bucket of each length a batch) or packed (an example's
source and target in the same row of their own grids) from unchanged code, as the same loop
written by hand with each example run alone at its exact lengths; ``layout="auto"`` prices
both; a resumed run is the uninterrupted one; every example is trained once an epoch."""

import dataclasses

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
from polyexec._errors import OptionError
from polyexec.training._several import JointBatching, JointPackedBatching

VOCAB, H, SEED = 9, 6, 3
OPT = optax.adam(3e-2)


class Seq2Seq(eqx.Module):
    """A self-attending encoder, a causal decoder and cross-attention: plain code, no masks."""

    embed: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    out: jax.Array

    def __init__(self, key):
        ks = jax.random.split(key, 5)
        self.embed = jax.random.normal(ks[0], (VOCAB, H)) * 0.5
        self.q, self.k, self.v = (jax.random.normal(k, (H, H)) * 0.5 for k in ks[1:4])
        self.out = jax.random.normal(ks[4], (H, VOCAB)) * 0.5

    def attend(self, q, kv, causal=False):            # (..., T, H), (..., S, H)
        scores = jnp.einsum("...td,...sd->...ts", q @ self.q, kv @ self.k) / np.sqrt(H)
        if causal:
            scores = jnp.where(jnp.tri(q.shape[-2], dtype=bool), scores, -1e9)
        return jax.nn.softmax(scores, -1) @ (kv @ self.v)

    def nll(self, src, tgt):                           # (..., S), (..., T) -> (..., T - 1)
        x = self.embed[src]
        x = x + self.attend(x, x)
        y = self.embed[tgt[..., :-1]]
        y = y + self.attend(y, y, causal=True)
        y = y + self.attend(y, x)
        logp = jax.nn.log_softmax(y @ self.out)
        return -jnp.take_along_axis(logp, tgt[..., 1:, None], -1)[..., 0]


def loss_fn(model, batch):                             # the mean over the batch's predictions
    return jnp.mean(model.nll(batch["src"], batch["tgt"]))


def dataset(n, seed):
    # Few length pairs (the reference compiles once for each), ragged in every batch.
    rng = np.random.default_rng(seed)
    return [{"src": rng.integers(1, VOCAB, rng.choice([1, 5, 12])).astype(np.int32),
             "tgt": rng.integers(1, VOCAB, rng.choice([2, 7])).astype(np.int32)}
            for _ in range(n)]


DATA = dataset(18, seed=0)
SIZES = np.array([[len(e["src"]), len(e["tgt"])] for e in DATA])


def by_hand(model, batches):
    """Each step: its examples' summed losses over their predictions, each example alone at its
    exact lengths; adam on the same batches in order."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    alone = jax.jit(jax.value_and_grad(
        lambda p, e: jnp.sum(eqx.combine(p, static).nll(e["src"], e["tgt"]))))
    opt_state, losses = OPT.init(params), []
    for idx in batches:
        results = [alone(params, DATA[i]) for i in idx]
        count = sum(len(DATA[i]["tgt"]) - 1 for i in idx)
        losses.append(sum(float(v) for v, _ in results) / count)
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / count, *(g for _, g in results))
        updates, opt_state = OPT.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return eqx.combine(params, static), losses


def test_examples_of_several_lengths_are_found_and_named_by_their_fields():
    examples = training.as_examples(DATA, "data")
    assert examples.form.lengths == ("src", "tgt")
    assert [f.dims for f in examples.form.fields] == [("src",), ("tgt",)]
    np.testing.assert_array_equal(examples.sizes, SIZES)
    batch, lengths = training.pad_batch(examples, [0, 1], 3, {"src": 12, "tgt": 7})
    assert batch["src"].shape == (3, 12) and batch["tgt"].shape == (3, 7)
    assert lengths["src"].tolist() == [*SIZES[:2, 0], 0]
    # Declared names stand; leaves whose sizes always agree share one length.
    declared = training.as_examples(DATA, "data", {"src": px.Spec("S"), "tgt": px.Spec("T")})
    assert declared.form.lengths == ("S", "T")
    same = [{"a": np.arange(n), "b": np.arange(n)} for n in (2, 5, 3)]
    assert training.as_examples(same, "data").form.lengths == ("T",)
    with pytest.raises(OptionError, match=r"data\[1\]\['b'\]\.shape\[0\] = 4 disagrees .*"
                                          r"name their axes apart"):
        training.as_examples([{"a": np.arange(3), "b": np.arange(3)},
                              {"a": np.arange(5), "b": np.arange(4)}], "data",
                             {"a": px.Spec("T"), "b": px.Spec("T")})
    with pytest.raises(OptionError, match=r"data\[0\]: expected an example of length tgt >= 1"):
        training.as_examples([{"src": np.arange(3), "tgt": np.arange(0)},
                              {"src": np.arange(2), "tgt": np.arange(4)}], "data")


def test_packed_steps_hold_every_example_once_in_the_rows_the_executor_packs():
    batching = JointPackedBatching(("src", "tgt"), (12, 7), 3, shuffle=True, seed=1,
                                   rooms=(0, 1))
    for epoch in (0, 1):
        steps = batching.epoch(SIZES, epoch)
        assert sorted(np.concatenate([s.indices for s in steps])) == list(range(len(DATA)))
        for s in steps:
            floor = np.maximum(SIZES[s.indices], 2)         # min_length=2, as fit's default
            cells = {"src": floor[:, 0], "tgt": floor[:, 1] + 1}
            _, _, rows = buckets.joint_first_fit(cells, {"src": 12, "tgt": 8})
            assert rows <= 3 and s.rows == 3 and s.sizes == (12, 7)
    padded = JointBatching(("src", "tgt"), (buckets.Fixed([6, 12]), buckets.Fixed([7])),
                           4, None, shuffle=True, seed=1)
    steps = padded.epoch(SIZES, 0)
    assert sorted(np.concatenate([s.indices for s in steps])) == list(range(len(DATA)))
    for s in steps:
        assert all(SIZES[i, 0] <= s.sizes[0] and (s.sizes[0] == 6 or SIZES[i, 0] > 6)
                   for i in s.indices)
    # Over 2 devices a batch keeps its examples, its rows filled up to split evenly.
    halves = dataclasses.replace(padded, batch_size=3, device_multiple=2).epoch(SIZES, 0)
    assert {len(s.indices) for s in halves} <= {1, 2, 3} and {s.rows for s in halves} == {4}
    assert max(len(s.indices) for s in halves) == 3


def planned(result, layout):
    """The batches fit ran, from the run's choice; each step trained exactly their tokens."""
    steps = [r for r in result.history if r["kind"] == "step"]
    names = ("src", "tgt")
    if layout == "pack":
        rows, *row_lengths = steps[0]["bucket"]
        batching = JointPackedBatching(names, tuple(row_lengths), rows, True, SEED)
    else:
        batching = JointBatching(names, tuple(result.policy[n] for n in names), 4, None, True,
                                 SEED)
    plan = batching.epoch(SIZES, 0)
    assert [r["tokens"] for r in steps] == [int(SIZES[b.indices].sum()) for b in plan]
    return [b.indices for b in plan], [r["loss"] for r in steps]


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_fit_trains_an_encoder_decoder_as_the_exact_loop_by_hand(layout):
    model = Seq2Seq(jax.random.PRNGKey(1))
    options = (dict(buckets={"src": [6, 12], "tgt": [7]}) if layout == "pad" else
               dict(layout="pack"))
    result = training.fit(model, loss_fn, DATA, optimizer=OPT, batch_size=4, seed=SEED,
                          verbose=False, cache=False, **options)
    assert result.layout == layout and result.train_step.traces == 1
    # One compile per shape the steps ran at.
    shapes = {tuple(r["bucket"]) for r in result.history if r["kind"] == "step"}
    assert result.train_step.stats.compiles == len(shapes) == (1 if layout == "pack" else 2)
    batches, losses = planned(result, layout)
    want_model, want_losses = by_hand(model, batches)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_trees_close(eqx.filter(result.model, eqx.is_array),
                       eqx.filter(want_model, eqx.is_array), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """layout="auto" with validation: interrupted after 3 steps and resumed, and the same run
    uninterrupted."""
    folder = tmp_path_factory.mktemp("several")
    args = dict(optimizer=OPT, epochs=2, batch_size=4, cache=False, verbose=False, seed=SEED,
                validation=dataset(5, seed=1))
    part = training.fit(Seq2Seq(jax.random.PRNGKey(1)), loss_fn, DATA, max_steps=3,
                        checkpoint_dir=folder, **args)
    rest = training.fit(Seq2Seq(jax.random.PRNGKey(1)), loss_fn, DATA, checkpoint_dir=folder,
                        **args)
    whole = training.fit(Seq2Seq(jax.random.PRNGKey(1)), loss_fn, DATA, **args)
    return part, rest, whole


def test_auto_prices_both_layouts_and_a_resumed_run_is_the_uninterrupted_one(resumed):
    part, rest, whole = resumed
    assert part.stopped_early and part.layout == rest.layout == whole.layout
    assert whole.prediction is not None and whole.prediction.steps == sum(
        r["kind"] == "step" for r in whole.history)
    assert_trees_close(rest.model, whole.model, rtol=0, atol=0)
    assert rest.val_loss == whole.val_loss and np.isfinite(whole.val_loss)
    epochs = whole.epochs()
    assert len(epochs) == 2 and epochs[-1]["train_loss"] < epochs[0]["train_loss"] + 0.5


def test_several_lengths_refuse_buckets_that_do_not_name_each_length():
    with pytest.raises(OptionError, match=r"fit: buckets: expected 'auto', an int K or a dict "
                                          r"naming each of the examples' lengths \('src', 'tgt'\)"):
        training.fit(Seq2Seq(jax.random.PRNGKey(1)), loss_fn, DATA, optimizer=OPT,
                     buckets=[12], verbose=False)
    with pytest.raises(OptionError, match=r"fit: buckets\['tgt'\]: expected a largest bucket "
                                          r">= 7"):
        training.fit(Seq2Seq(jax.random.PRNGKey(1)), loss_fn, DATA, optimizer=OPT,
                     buckets={"src": [12], "tgt": [4]}, verbose=False)


class Towers(eqx.Module):
    embed: jax.Array
    w: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed, self.w = jax.random.normal(k1, (VOCAB, H)), jax.random.normal(k2, (H, H))

    def query(self, tokens):                          # (..., Q) -> (..., H)
        return jnp.tanh(self.embed[tokens] @ self.w).mean(-2)

    def doc(self, tokens):
        return jnp.tanh(self.embed[tokens]).max(-2)


def in_batch_loss(model, batch):       # every query against every document of the batch
    scores = model.query(batch["query"]) @ model.doc(batch["doc"]).T
    return -jnp.mean(jnp.diag(jax.nn.log_softmax(scores, -1)))


def test_a_dual_encoders_in_batch_loss_trains_padded_naming_its_line_and_exact():
    """It couples the examples of a batch, which packed rows cannot hold: ``"auto"`` pads,
    saying why; ``"pack"`` is refused; padded, each step's loss is the exact one, a partial
    batch's added rows no rows."""
    rng = np.random.default_rng(2)
    data = [{"query": rng.integers(0, VOCAB, rng.choice([2, 5])),
             "doc": rng.integers(0, VOCAB, rng.choice([3, 8, 19]))} for _ in range(14)]
    model = Towers(jax.random.PRNGKey(0))
    with pytest.raises(OptionError, match=r"layout='pack': the train step cannot pack: .*"
                                          r"test_fit_several.py:\d+: `scores = model.query"):
        training.fit(model, in_batch_loss, data, optimizer=OPT, layout="pack", verbose=False)
    result = training.fit(model, in_batch_loss, data, optimizer=optax.sgd(0.0), batch_size=4,
                          buckets={"doc": [8, 19], "query": [5]}, seed=SEED, verbose=False,
                          cache=False)
    sizes = np.array([[len(e["doc"]), len(e["query"])] for e in data])
    plan = JointBatching(("doc", "query"), tuple(result.policy.values()), 4, None, True,
                         SEED).epoch(sizes, 0)
    assert any(len(b.indices) < 4 for b in plan)              # partial batches, rows added

    def exact(idx):                                           # each tower alone per example
        q = jnp.stack([model.query(data[i]["query"]) for i in idx])
        d = jnp.stack([model.doc(data[i]["doc"]) for i in idx])
        return -jnp.mean(jnp.diag(jax.nn.log_softmax(q @ d.T, -1)))
    losses = [r["loss"] for r in result.history if r["kind"] == "step"]
    np.testing.assert_allclose(losses, [exact(b.indices) for b in plan], rtol=1e-5)
