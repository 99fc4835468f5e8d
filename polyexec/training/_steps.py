"""Pure train/eval step functions and their bucketed, compiled-per-bucket versions."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import Bucketed, LengthVar, Spec, bucketed
from .._errors import OptionError
from ._data import BatchForm
from ._state import TrainState, trainable

# Loss functions see a padded batch: the examples' pytree with a leading B (the one-field
# shorthand: tokens (B, T) and the real lengths (B,)); see `as_loss_call`.
LossFn = Callable[..., jax.Array]
EvalFn = Callable[..., "tuple[jax.Array, jax.Array]"]


def step_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """``(train, evaluation)``: the keys `fit` derives a loss's keys from. Train step ``s``
    (0-based, counted over the whole run, resumes included) gets ``jax.random.fold_in(train,
    s)``; evaluation always gets ``evaluation``.

    >>> import jax
    >>> from polyexec.training import step_keys
    >>> train, _ = step_keys(0)
    >>> jax.random.key_data(jax.random.fold_in(train, 3)).shape
    (2,)
    """
    train, evaluation = jax.random.split(jax.random.key(seed))
    return train, evaluation


@dataclasses.dataclass(frozen=True)
class LossCall:
    """How `fit` calls the user's ``loss_fn`` (or ``eval_fn``): ``call(model, batch, lengths,
    key)`` passes what the function asks for, read once from its signature.

    The batch is the second positional argument. A parameter named ``lengths`` receives the
    real lengths ``(B,)`` int32, and one named ``key`` a fresh PRNG key (by keyword). The
    one-field shorthand ``loss_fn(model, tokens, lengths)`` takes the lengths as its third
    positional argument, whatever it names it. One named ``state`` (``wants_state``): the model
    is an equinox ``(model, eqx.nn.State)`` pair, as ``eqx.nn.make_with_state`` returns it;
    the function gets the module first and the state by name, and a loss returns ``(loss,
    new_state)`` (see `call_with_state`)."""

    fn: Callable
    lengths: str | None       # "positional", "keyword" or None
    wants_key: bool
    wants_state: bool = False

    def __call__(self, model, batch, lengths, key=None):
        state = None
        if self.wants_state:
            model, state = model
        args = (model, batch) + ((lengths,) if self.lengths == "positional" else ())
        kwargs = ({"lengths": lengths} if self.lengths == "keyword" else {}) | (
            {"key": key} if self.wants_key else {}) | (
            {"state": state} if self.wants_state else {})
        return self.fn(*args, **kwargs)


def call_with_state(loss_fn, model, batch, lengths, *keyed):
    """``(what loss_fn returned, the model after the call)``. A loss asking for ``state``
    returns ``(result, new_state)``: the model comes back as ``(module, new_state)``, as the
    functional ``eqx.nn.State`` pattern threads it; any other loss returns its result alone."""
    out = loss_fn(model, batch, lengths, *keyed)
    if getattr(loss_fn, "wants_state", False):
        out, state = out
        return out, (model[0], state)
    return out, model


def as_loss_call(fn: Callable, where: str, *, one_field: bool) -> LossCall:
    """`LossCall` of ``fn``; a required parameter it would not be given is an `OptionError`
    naming it (before anything traces). A function whose signature cannot be read is called
    ``(model, tokens, lengths)`` (one field) or ``(model, batch)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return LossCall(fn, "positional" if one_field else None, False)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    wants_key = "key" in named
    wants_state = "state" in named
    rest = [p for p in positional[2:] if p.name not in ("key", "state")]
    if one_field and (rest or any(p.kind == p.VAR_POSITIONAL for p in params)):
        lengths = "positional"
    elif "lengths" in named:
        lengths = "keyword"
    else:
        lengths = None
    given = {p.name for p in positional[:2]} | ({"key"} if wants_key else set()) | (
        {"state"} if wants_state else set()) | (
        {"lengths"} if lengths == "keyword" else
        {rest[0].name} if lengths == "positional" and rest else set())
    missing = [p.name for p in params if p.default is p.empty and p.name not in given
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        missing = missing or ["(a second positional parameter: the batch)"]
    if missing:
        form = "(model, tokens, lengths)" if one_field else "(model, batch)"
        raise OptionError(f"{where}: expected a callable {form} with optional parameters named "
                          f"lengths, key and state, received one that also requires "
                          f"{', '.join(map(repr, missing))}")
    return LossCall(fn, lengths, wants_key, wants_state)


def train_step_fn(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                  return_grads: bool = False, seed: int | None = None, has_aux: bool = False):
    """The pure train step ``(state, batch, lengths) -> (new_state, metrics)``.

    ``jax.value_and_grad`` of ``loss_fn(model, batch, lengths)`` -- with ``seed``,
    ``loss_fn(model, batch, lengths, key)``, ``key`` the step's (`step_keys`: from ``seed``
    and ``state.step``, so a resumed run draws the keys an uninterrupted one does) -- with
    respect to the model's trainable arrays (`trainable`), then ``optimizer.update`` and
    ``optax.apply_updates``; what the call writes into the model's other state (an NNX RNG
    count, batch statistics) is kept, as ``nnx.jit`` keeps it. A step whose loss or gradient
    is not finite changes nothing but ``step``. ``metrics`` holds ``loss``, ``grad_norm`` and
    ``finite`` (a bool: loss and every gradient element finite; and ``grads`` with
    ``return_grads``). With ``has_aux`` the loss returns ``(loss, aux)``, as for
    ``jax.value_and_grad(..., has_aux=True)``, and ``metrics["aux"]`` is ``aux``. It knows no sizes:
    `make_train_step` compiles it once per length bucket; ``jax.jit`` of it is the exact-shape
    reference the tests compare against.

    >>> import equinox as eqx, jax, jax.numpy as jnp, optax
    >>> from polyexec.training import TrainState, train_step_fn
    >>> def loss(model, tokens, lengths):
    ...     return jnp.mean(jax.vmap(model)(tokens.astype(jnp.float32)) ** 2)
    >>> model = eqx.nn.Linear(3, 1, key=jax.random.PRNGKey(0))
    >>> step = train_step_fn(loss, optax.sgd(0.1))
    >>> state, metrics = step(TrainState.create(model, optax.sgd(0.1)), jnp.ones((2, 3)), jnp.full(2, 3))
    >>> int(state.step), metrics["loss"].shape
    (1, ())
    """

    def train_step(state: TrainState, batch, lengths):
        params, rest = trainable(state.model)
        keyed = () if seed is None else (jax.random.fold_in(step_keys(seed)[0], state.step),)

        def loss_of(p):
            loss, model = call_with_state(loss_fn, eqx.combine(p, rest), batch, lengths, *keyed)
            loss, aux = loss if has_aux else (loss, None)
            # What the call wrote into the model's state -- an NNX Dropout's RngCount, a
            # BatchNorm's running statistics -- is read back from it here, as nnx.jit's
            # split/merge does; dropped, every step drew the first step's dropout mask
            # again and the statistics never moved. (An equinox model's rest comes back as
            # is, its eqx.nn.State as the loss returned it.)
            return loss, (_written(model, rest), aux)

        (loss, (rest, aux)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.combine(optax.apply_updates(params, updates), rest)
        leaves = jax.tree_util.tree_leaves(grads)
        # The global L2 norm (optax.global_norm is deprecated, its successor needs optax>=0.2.5).
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in leaves))
        # Every gradient element checked, not the norm: a finite gradient above ~1e19 squares
        # to inf in float32. One fused reduction per leaf, read on the host with the loss.
        finite = jnp.isfinite(loss)
        for g in leaves:
            finite = finite & jnp.all(jnp.isfinite(g))
        # A non-finite step is never applied: parameters, optimiser state and the model's
        # written state (NaN batch statistics) stay as they were; fit stops or skips on the
        # host. (Applied, one NaN batch made every weight NaN and was checkpointed.)
        model, opt_state = jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old) if eqx.is_array(new) else new,
            (model, opt_state), (state.model, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
        if has_aux:
            metrics["aux"] = aux
        if return_grads:
            metrics["grads"] = grads
        return TrainState(model=model, opt_state=opt_state, step=state.step + 1), metrics

    return train_step


def check_loss(call: LossCall, model, batch, lengths, *, where: str = "fit: loss_fn",
               has_aux: bool = False, pair: bool = False, on: str = "") -> None:
    """Refuse, before anything compiles, a loss whose result breaks the contract: a scalar
    floating-point loss (``has_aux``: a pair ``(loss, aux)``, ``aux`` a pytree of scalars,
    logged per epoch); ``pair``: an ``eval_fn``'s ``(summed loss, count)`` of two scalars.
    ``on`` says what the batch was (`` on a batch of 2 examples``), for the message.

    Read with ``jax.eval_shape`` on one example batch: nothing compiles. (Unchecked, a vector
    loss was refused as a shape-polymorphism problem at ``<unknown location>``, a tuple or an
    int got JAX's raw ``TypeError`` from inside the train step.) A loss that fails to trace
    on this batch is left to the step's own trace, which reports it with the user's line.

    >>> import jax.numpy as jnp, numpy as np
    >>> call = as_loss_call(lambda model, batch: batch * model, "fit: loss_fn", one_field=False)
    >>> check_loss(call, 2.0, np.ones((1, 3), np.float32), np.array([3], np.int32))
    Traceback (most recent call last):
    polyexec._errors.OptionError: fit: loss_fn: expected a scalar floating-point loss (shape (), e.g. float32[]; has_aux=True for a pair (loss, aux)), received an array float32[1,3]: reduce it to one number (e.g. .mean())
    """
    key = jax.random.key(0) if call.wants_key else None
    if call.wants_state and not (isinstance(model, (tuple, list)) and len(model) == 2
                                 and isinstance(model[1], eqx.nn.State)):
        raise OptionError(f"{where}: asks for state (a parameter named state): expected the "
                          f"model as a (model, eqx.nn.State) pair, as eqx.nn.make_with_state "
                          f"returns it, received {type(model).__name__}")
    try:
        # filter_: a model's non-array leaves (functions, names) are static, as in the step.
        out = eqx.filter_eval_shape(lambda m, b, n: call(m, b, n, key), model, batch, lengths)
    except Exception:      # noqa: BLE001 -- the step's own trace reports it, at the user's line
        return
    if call.wants_state and not pair:
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and isinstance(out[1], eqx.nn.State)):
            raise OptionError(f"{where}: asks for state: expected a pair (loss, new_state) "
                              f"(new_state the eqx.nn.State the model returned), received "
                              f"{_described(out)}")
        out = out[0]
    if pair:
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and all(_is_scalar(x) or isinstance(x, (int, float)) for x in out)):
            raise OptionError(f"{where}: expected a pair (summed loss, count) of two scalars, "
                              f"received {_described(out)}")
        return
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise OptionError(f"{where}: expected a pair (loss, aux) (has_aux=True), received "
                              f"{_described(out)}")
        out, aux = out
        bad = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(aux)[0]
               if not _is_scalar(x)]
        if bad:
            path, x = bad[0]
            raise OptionError(f"{where}: aux{jax.tree_util.keystr(path)}: expected a pytree of "
                              f"scalars (each averaged over the epoch and logged), received "
                              f"{_described(x)}")
    expected = ("expected a scalar floating-point loss (shape (), e.g. float32[]"
                + ("" if has_aux else "; has_aux=True for a pair (loss, aux)") + ")")
    if isinstance(out, (tuple, list)):
        raise OptionError(f"{where}: {expected}, received {_described(out)}"
                          + ("" if has_aux or len(out) != 2 else
                             "; to return (loss, aux), pass has_aux=True"))
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise OptionError(f"{where}: {expected}, received {_described(out)}")
    if out.shape != ():
        raise OptionError(f"{where}: {expected}, received {_described(out)}{on}: reduce it to "
                          f"one number (e.g. .mean())")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise OptionError(f"{where}: {expected}, received {_described(out)}: a gradient needs a "
                          f"floating-point loss (cast with .astype(jnp.float32), or compute it "
                          f"from floats)")


def _is_scalar(x) -> bool:
    return (isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()
            and (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)))


def _described(x) -> str:
    """What a function returned, by shapes and dtypes: ``an array float32[4]``, ``a tuple of
    2: (float32[], {'n': int32[]})``."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{'a scalar' if x.shape == () else 'an array'} {_shape(x)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: {_shape(x)}"
    return f"{type(x).__name__}: {_shape(x)}"


def _shape(x) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype.name}[{','.join(map(str, x.shape))}]"
    if isinstance(x, tuple):
        return "(" + ", ".join(map(_shape, x)) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, list):
        return "[" + ", ".join(map(_shape, x)) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_shape(v)}" for k, v in x.items()) + "}"
    return repr(x)


def _written(model, rest):
    """The state part of ``model`` (`trainable`) after a loss call, checked to be the same
    tree as ``rest`` was before it: a layer that made new attributes during the call would
    otherwise change the model's structure from one step to the next."""
    _, after = trainable(model)
    if jax.tree_util.tree_structure(after) != jax.tree_util.tree_structure(rest):
        raise OptionError(f"fit: loss_fn: expected a call that keeps the model's structure "
                          f"(writing only the values of its existing state), received one that "
                          f"changed it: before {jax.tree_util.tree_structure(rest)}, after "
                          f"{jax.tree_util.tree_structure(after)}")
    return after


def eval_step_fn(loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None, *,
                 seed: int | None = None, has_aux: bool = False):
    """The pure eval step ``(model, batch, lengths) -> (total, count)``.

    With ``eval_fn`` (returning a summed loss and the number of terms it sums, e.g. predicted
    tokens) averages across batches are exact. Without it, ``loss_fn``'s mean is weighted by
    the batch's real tokens, ``sum(lengths)`` (with ``has_aux``, the loss of its ``(loss,
    aux)``). With ``seed``, the function is called with the
    evaluation key of `step_keys` last (the same for every batch and epoch).
    """
    def keyed():     # made inside the trace: a key is no constant of the program
        return () if seed is None else (step_keys(seed)[1],)

    if eval_fn is not None:
        def eval_step(model, batch, lengths):
            total, count = eval_fn(model, batch, lengths, *keyed())   # state read, not written
            return jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32)
    elif loss_fn is not None:
        def eval_step(model, batch, lengths):
            # Several lengths: one count per example (which length a loss averages over is
            # its own; an eval_fn says it exactly).
            count = (jnp.sum(lengths).astype(jnp.float32) if not isinstance(lengths, dict) else
                     jnp.sum(next(iter(lengths.values())) > 0).astype(jnp.float32))
            loss, _ = call_with_state(loss_fn, model, batch, lengths, *keyed())
            loss = loss[0] if has_aux else loss
            return loss.astype(jnp.float32) * count, count
    else:
        raise OptionError("eval_step_fn: expected loss_fn or eval_fn, received neither")
    return eval_step


def _bucketed_step(step: Callable, *, name: str,
                   length_buckets: Sequence[int] | Mapping[str, Sequence[int]],
                   batch_buckets: Sequence[int], min_length: int, pad_id: int,
                   shardings: tuple | None, masking: bool,
                   donate_argnums: tuple[int, ...] = (), layout: str = "pad",
                   form: BatchForm | None = None) -> Bucketed:
    """``step(state or model, batch, lengths (B,))`` compiled once per (B, T) bucket; the
    batch is ``form``'s (`BatchForm.specs`), by default tokens ``(B, T)`` int32.

    ``B`` and ``T`` are this step's own LengthVars, carried by its Specs and keyed in
    ``buckets``: the Specs resolve against them, never against a ``"T"`` defined elsewhere in
    the user's process. ``T >= min_length`` (2 by default) is a constraint of the one symbolic
    trace: next-token losses slice ``tokens[:, :-1]``, which needs T >= 2. ``lengths`` makes
    ``T`` ragged along ``B``: the loss sees each row at its own length (no mask needed).
    A form of several lengths has one LengthVar each, ``length_buckets`` a mapping name ->
    buckets, and ``lengths`` a dict name -> ``(B,)``.
    """
    if not isinstance(length_buckets, Mapping):
        length_buckets = {n: length_buckets for n in (form.lengths if form else ("T",))}
    lengths = {n: LengthVar(n, min=min_length, max=max(b)) for n, b in length_buckets.items()}
    # Packed, B counts sequences: as many as the largest grid holds of the shortest (each
    # example takes a cell or more of every length's rows).
    most = min(T.max for T in lengths.values()) // min_length
    B = LengthVar("B", max=max(batch_buckets) * (1 if layout == "pad" else most))
    batch = None if shardings is None else shardings[1]
    if form is not None:
        specs = form.specs(B, lengths)
    else:
        specs = Spec((B, lengths["T"]), jnp.int32, pad=pad_id)
    given = {n: Spec((B,), jnp.int32, lengths_of=T) for n, T in lengths.items()}
    return bucketed(step, in_specs=(None, specs,
                                    given if len(given) > 1 else next(iter(given.values()))),
                    buckets={**{lengths[n]: list(b) for n, b in length_buckets.items()},
                             B: list(batch_buckets)},
                    donate_argnums=donate_argnums, name=name, masking=masking, layout=layout,
                    in_shardings=None if shardings is None else (shardings[0], batch, batch))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    length_buckets: Sequence[int] | Mapping[str, Sequence[int]],
                    batch_buckets: Sequence[int],
                    min_length: int = 2, pad_id: int = 0, shardings: tuple | None = None,
                    donate: bool = True,
                    return_grads: bool = False, masking: bool = True,
                    layout: str = "pad", form: BatchForm | None = None,
                    seed: int | None = None, has_aux: bool = False) -> Bucketed:
    """`train_step_fn` as a `px.bucketed` function, compiled once per (B, T) bucket.

    ``state`` is not length-polymorphic (its arrays keep their shapes) and is donated, so XLA
    updates the parameters and optimiser state in place. ``shardings`` = (state sharding, batch
    sharding) for data parallelism: parameters replicated, the batch axis split over a Mesh.
    ``masking=False`` turns off the executor's logical-length rewrite; ``layout`` is
    `px.bucketed`'s (``"auto"`` for `choose_layout`, which pins pad or pack by cost).
    ``form``: the batch's `BatchForm` (default: tokens ``(B, T)`` int32; a form of several
    lengths takes ``length_buckets`` per name and ``lengths`` as a dict); ``seed``: the loss
    takes a key last; ``has_aux``: it returns ``(loss, aux)`` (`train_step_fn`).

    >>> import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
    >>> from polyexec.training import TrainState, make_train_step
    >>> def loss(model, tokens, lengths):          # masked mean of a per-token score
    ...     mask = jnp.arange(tokens.shape[1]) < lengths[:, None]
    ...     scores = jax.vmap(jax.vmap(model))(tokens.astype(jnp.float32)[..., None])[..., 0]
    ...     return jnp.sum(jnp.where(mask, scores ** 2, 0)) / jnp.maximum(jnp.sum(mask), 1)
    >>> opt = optax.adam(1e-2)
    >>> step = make_train_step(loss, opt, length_buckets=[8, 16], batch_buckets=[4])
    >>> state = TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), opt)
    >>> state, metrics = step(state, np.ones((4, 5), np.int32), np.array([5, 3, 2, 1], np.int32))
    >>> int(state.step), step.stats.compiles, step.plan.reshaping_is_impossible
    (1, 1, False)
    """
    return _bucketed_step(train_step_fn(loss_fn, optimizer, return_grads=return_grads,
                                        seed=seed, has_aux=has_aux),
                          name="train_step", length_buckets=length_buckets,
                          batch_buckets=batch_buckets, min_length=min_length, pad_id=pad_id,
                          shardings=shardings, masking=masking, layout=layout,
                          donate_argnums=(0,) if donate else (), form=form)


def make_eval_step(loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None, *,
                   length_buckets: Sequence[int] | Mapping[str, Sequence[int]],
                   batch_buckets: Sequence[int],
                   min_length: int = 2, pad_id: int = 0, shardings: tuple | None = None,
                   masking: bool = True, layout: str = "pad", form: BatchForm | None = None,
                   seed: int | None = None, has_aux: bool = False) -> Bucketed:
    """`eval_step_fn` as a `px.bucketed` function: ``(model, batch, lengths) -> (total,
    count)``."""
    return _bucketed_step(eval_step_fn(loss_fn, eval_fn, seed=seed, has_aux=has_aux),
                          name="eval_step",
                          layout=layout, length_buckets=length_buckets,
                          batch_buckets=batch_buckets, min_length=min_length, pad_id=pad_id,
                          shardings=shardings, masking=masking, form=form)
