"""polyexec.training: fit any equinox model with an optax optimiser through bucketed steps.

The train step (``jax.value_and_grad`` + optax update, state donated) and the eval step are
traced once over symbolic lengths and compiled once per bucket; the bucket set is chosen by
predicted run time from one measured compile and step (``buckets="auto"``), compiled ahead of time on parallel threads (into JAX's persistent
compile cache with ``cache=True``), and every epoch reports its padding efficiency (the train
step's own ``stats``), compiles and throughput. Checkpoints hold the
model, optimiser state, step and data order, so an interrupted run resumes to the same result.
Data parallel over local devices (and hosts) with ``jax.sharding``.

>>> import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
>>> from polyexec import training
>>> def loss(model, batch):                      # batch["x"]: (B, T), padded to a bucket
...     x = batch["x"].astype(jnp.float32)[..., None] / 10
...     return jnp.mean((jax.vmap(jax.vmap(model))(x)[..., 0] - 1.0) ** 2)  # real cells only
>>> data = [{"x": np.arange(n) % 5} for n in range(2, 30)]
>>> result = training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), loss, data,
...                       optimizer=optax.adam(1e-2), epochs=2, batch_size=4, buckets=3,
...                       verbose=False)
>>> result.train_step.traces, result.train_step.stats.compiles
(1, 3)

Examples that are bare 1-D token arrays may use the shorthand ``loss(model, tokens,
lengths)``. See `fit` for checkpoints, data parallelism (including multi-host with
``jax.distributed.initialize()``), metrics files and the persistent compile cache.
"""

from ._auto import BucketChoice, LayoutChoice, choose_buckets, choose_layout, measure_cost
from ._checkpoint import (CheckpointError, CheckpointWarning, CorruptCheckpointError,
                          checkpoint_dir_lock, latest_checkpoint, list_checkpoints,
                          load_checkpoint, read_meta, save_checkpoint, verify_checkpoint)
from ._data import BatchForm, Examples, Field, as_examples, pad_batch
from ._fit import FitResult, NonFiniteError, StepInfo, StopTraining, evaluate, fit
from ._options import FitOptions
from ._outputs import check_output_dir, check_output_file
from ._parallel import DataParallel, data_parallel, initialize_distributed, parse_coordinator
from ._state import TrainState
from ._steps import (LossCall, as_loss_call, eval_step_fn, make_eval_step, make_train_step,
                     step_keys, train_step_fn)

__all__ = [
    "fit", "FitOptions", "FitResult", "StepInfo", "StopTraining", "NonFiniteError", "evaluate",
    "TrainState", "measure_cost", "choose_buckets", "BucketChoice", "choose_layout",
    "LayoutChoice", "train_step_fn",
    "eval_step_fn", "make_train_step", "make_eval_step", "step_keys", "LossCall", "as_loss_call",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "read_meta",
    "verify_checkpoint", "checkpoint_dir_lock", "CheckpointError", "CorruptCheckpointError",
    "CheckpointWarning",
    "DataParallel", "data_parallel", "initialize_distributed", "parse_coordinator", "Examples",
    "as_examples",
    "pad_batch", "BatchForm", "Field", "check_output_dir", "check_output_file",
]
