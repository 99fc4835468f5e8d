"""Checkpoints: one file per save holding a JSON header and the equinox-serialised state.

A file is ``MAGIC\\n``, one line of JSON (step, data-order position, metrics so far, a
fingerprint of the run's data and batching), then ``eqx.tree_serialise_leaves`` of the
`TrainState` (model, optimiser state, step). It is written to a temporary file in the same
folder and moved into place with ``os.replace``, which is atomic: a run killed while saving
leaves the previous checkpoint intact, never a torn one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import equinox as eqx

from .._errors import OptionError

MAGIC = b"polyexec-checkpoint-v1"
_NAME = re.compile(r"^step-(\d{9})\.ckpt$")


def _path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.ckpt")


def list_checkpoints(directory: str | os.PathLike) -> list[str]:
    """The checkpoint files in ``directory``, oldest step first."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if _NAME.match(n))
    return [os.path.join(directory, n) for n in names]


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest checkpoint file in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(directory: str | os.PathLike, state: Any, meta: dict, *, keep: int | None = 3) -> str:
    """Write ``state`` (any pytree, usually a `TrainState`) and ``meta`` atomically; return the
    path. ``meta['step']`` names the file. Only the newest ``keep`` checkpoints are kept.

    >>> import tempfile, equinox as eqx, jax, optax
    >>> from polyexec.training import TrainState, save_checkpoint, load_checkpoint
    >>> state = TrainState.create(eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0)), optax.adam(1e-3))
    >>> d = tempfile.mkdtemp()
    >>> path = save_checkpoint(d, state, {"step": 0, "epoch": 0, "position": 0})
    >>> restored, meta = load_checkpoint(path, like=state)
    >>> meta["position"], bool((restored.model.weight == state.model.weight).all())
    (0, True)
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    step = int(meta["step"])
    header = json.dumps(meta, sort_keys=True).encode()   # one line: json.dumps escapes newlines
    target = _path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=f".step-{step:09d}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + b"\n" + header + b"\n")
            eqx.tree_serialise_leaves(f, state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if keep is not None:
        for old in list_checkpoints(directory)[:-keep]:
            if old != target:
                os.unlink(old)
    return target


def read_meta(path: str | os.PathLike) -> dict:
    """The JSON header of a checkpoint, without reading the arrays."""
    with open(path, "rb") as f:
        return _read_header(f, path)


def _read_header(f, path) -> dict:
    magic = f.readline().rstrip(b"\n")
    if magic != MAGIC:
        raise OptionError(f"{os.fspath(path)}: expected a polyexec checkpoint (first line "
                          f"{MAGIC!r}), received first line {magic[:40]!r}")
    return json.loads(f.readline())


def load_checkpoint(path: str | os.PathLike, like: Any) -> tuple[Any, dict]:
    """Read a checkpoint into the structure of ``like`` (a state built the same way as the
    saved one); return ``(state, meta)``."""
    with open(path, "rb") as f:
        meta = _read_header(f, path)
        try:
            state = eqx.tree_deserialise_leaves(f, like)
        except Exception as e:  # a different model size, optimiser or cell type
            raise OptionError(f"{os.fspath(path)}: expected a checkpoint of the state's structure "
                              f"and shapes, received one that does not match them "
                              f"({type(e).__name__}: {e})") from e
    return state, meta


