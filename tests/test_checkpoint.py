"""Checkpoints survive damage: each class of damage to real checkpoints (written by
`save_checkpoint`) is reported, and the previous intact checkpoint is the one used."""

from __future__ import annotations

import errno
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
import pytest

import polyexec as px
from polyexec import training
from polyexec.training import _checkpoint as ck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = 0.123456   # a value only the embedding holds, to find it in the file


class Tiny(eqx.Module):
    embed: jax.Array
    head: eqx.nn.Linear

    def __init__(self, seed):
        key = jax.random.PRNGKey(seed)
        self.embed = jnp.full((3, 2), MARK + seed, dtype=jnp.float32)
        self.head = eqx.nn.Linear(2, 1, key=key)


def state_at(step):
    return training.TrainState.create(Tiny(step), optax.adam(1e-3))


def save(folder, step, keep=3):
    return training.save_checkpoint(folder, state_at(step), {"step": step, "epoch": 0,
                                                             "position": step}, keep=keep)


def assert_same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(autouse=True)
def let_folders_go():
    """A save keeps its folder for the process; give each test's folders back after it."""
    yield
    for key in list(ck._held):
        ck.release_checkpoint_dir(key)


@pytest.fixture
def three(tmp_path):
    """Checkpoints of steps 1, 2, 3 in tmp_path; the newest path."""
    for step in (1, 2, 3):
        newest = save(tmp_path, step)
    return tmp_path, newest


def resumes_from_step_2(folder, *, warning):
    """What fit does at start: the newest intact checkpoint, loaded; it must be step 2's and the
    damage of step 3's file must have been reported (``warning``: words of the message)."""
    with pytest.warns(ck.CheckpointWarning, match=warning) as caught:
        path = training.latest_checkpoint(folder)
    assert path == os.path.join(folder, "step-000000002.ckpt")
    assert "step-000000003.ckpt" in str(caught[0].message)
    assert "using the previous intact checkpoint" in str(caught[0].message)
    restored, meta = training.load_checkpoint(path, like=state_at(0))
    assert meta["step"] == 2 and training.read_meta(path)["position"] == 2
    assert_same(restored, state_at(2))


def test_a_flipped_weight_is_found_and_the_previous_checkpoint_used(three):
    folder, newest = three
    data = open(newest, "rb").read()
    mark = np.float32(MARK + 3).tobytes()
    assert data.count(mark) == 6
    with open(newest, "r+b") as f:   # one embedding weight overwritten with 1000.0
        f.seek(data.index(mark))
        f.write(np.float32(1000.0).tobytes())
    with pytest.raises(ck.CorruptCheckpointError, match="step-000000003.ckpt: expected SHA-256 "
                       r".*found .*the header or the arrays were changed after saving"):
        training.load_checkpoint(newest, like=state_at(0))
    resumes_from_step_2(folder, warning="changed after saving")


def test_a_truncated_newest_checkpoint_is_reported_and_skipped(three):
    folder, newest = three
    size = os.path.getsize(newest)
    os.truncate(newest, size // 2)
    with pytest.raises(ck.CorruptCheckpointError, match=r"expected \d+ bytes of arrays, found "
                       r"\d+ \(truncated\)"):
        training.load_checkpoint(newest, like=state_at(0))
    resumes_from_step_2(folder, warning="truncated")
    # Cut inside the header too: still reported as damage, not a traceback.
    os.truncate(newest, 30)
    resumes_from_step_2(folder, warning="expected a header line, found the file cut short")


def test_an_edited_header_is_found(three):
    folder, newest = three
    data = open(newest, "rb").read()
    assert data.count(b'"step": 3') == 1
    open(newest, "wb").write(data.replace(b'"step": 3', b'"step": 4'))   # same length
    with pytest.raises(ck.CorruptCheckpointError, match="changed after saving"):
        training.read_meta(newest)
    resumes_from_step_2(folder, warning="expected SHA-256")


def test_a_header_that_is_not_json_is_reported(three):
    folder, newest = three
    lines = open(newest, "rb").read().split(b"\n", 2)
    open(newest, "wb").write(b"\n".join([lines[0], b"{not json", lines[2]]))
    with pytest.raises(ck.CorruptCheckpointError, match="expected a JSON header on line 2, "
                       "found b'{not json"):
        training.load_checkpoint(newest, like=state_at(0))
    resumes_from_step_2(folder, warning="expected a JSON header")


def test_a_deleted_newest_checkpoint_leaves_the_previous_one(three):
    folder, newest = three
    os.remove(newest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing is damaged: no warning
        path = training.latest_checkpoint(folder)
    assert os.path.basename(path) == "step-000000002.ckpt"
    assert_same(training.load_checkpoint(path, like=state_at(0))[0], state_at(2))


def test_a_directory_named_like_the_newest_checkpoint(three):
    folder, newest = three
    os.remove(newest)
    os.mkdir(newest)
    with pytest.raises(ck.CorruptCheckpointError, match="expected a checkpoint file, found a "
                       "directory"):
        training.read_meta(newest)
    resumes_from_step_2(folder, warning="found a directory")
    # Pruning neither deletes it nor counts it among the kept checkpoints.
    save(folder, 4, keep=1)
    assert os.path.isdir(newest)
    assert [os.path.basename(p) for p in training.list_checkpoints(folder)] == [
        "step-000000003.ckpt", "step-000000004.ckpt"]


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(three):
    folder, newest = three
    for path in training.list_checkpoints(folder):
        os.truncate(path, 100)
    with pytest.raises(ck.CorruptCheckpointError, match=r"expected at least one intact "
                       r"checkpoint to resume from, found 3 and every one is damaged: .*"
                       r"step-000000003.ckpt.*step-000000001.ckpt.*resume=False") as info:
        training.latest_checkpoint(folder)
    assert isinstance(info.value, px.PolyexecError)


def _python(code, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


SAVE_IN_CHILD = """
    import os, sys, optax, jax.numpy as jnp, equinox as eqx
    from polyexec import training

    class Tiny(eqx.Module):
        embed: object

    folder, mode = sys.argv[1], sys.argv[2]
    state = training.TrainState.create(Tiny(jnp.ones((3, 2))), optax.adam(1e-3))
    if mode == "killed":      # killed (no cleanup runs) just before the rename
        os.replace = lambda *a: os._exit(9)
    training.save_checkpoint(folder, state, {"step": 9})
    print("saved", flush=True)
    sys.stdin.readline()      # keep the folder until told to end
"""


def test_a_temp_file_of_an_interrupted_save_is_removed_on_the_next_start(three):
    folder, newest = three
    ck.release_checkpoint_dir(folder)   # the fixture's saves took it for this process
    child = _python(SAVE_IN_CHILD, folder, "killed")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 9, err[-2000:]
    temps = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(".step-000000009."), os.listdir(folder)
    # fit's start (latest_checkpoint) removes it; the checkpoints are untouched.
    assert training.latest_checkpoint(folder) == newest
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]
    assert_same(training.load_checkpoint(newest, like=state_at(0))[0], state_at(3))
    # A run that does not resume removes them at its first save.
    open(os.path.join(folder, ".step-000000009.x1.tmp"), "wb").write(b"half")
    save(folder, 4)
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]


def test_a_second_writer_is_refused_naming_the_folder_and_the_holder(three):
    folder, newest = three
    ck.release_checkpoint_dir(folder)   # the fixture's saves took it for this process
    child = _python(SAVE_IN_CHILD, folder, "hold")
    try:
        assert child.stdout.readline() == "saved\n", child.stderr.read()[-2000:]
        with pytest.raises(ck.CheckpointError, match=rf"{re.escape(str(folder))}: expected a checkpoint folder no "
                           rf"other run is writing to, found it held by pid {child.pid} on "):
            save(folder, 10)
        assert not os.path.exists(os.path.join(folder, "step-000000010.ckpt"))
        # The reader side is not blocked, and the holder's files are all intact.
        assert training.latest_checkpoint(folder) == os.path.join(folder, "step-000000009.ckpt")
        with pytest.raises(ck.CheckpointError, match=f"held by pid {child.pid}"):
            with ck.checkpoint_dir_lock(folder):
                pass
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    # The holder has ended: the folder is free; a block lets it go again afterwards.
    with ck.checkpoint_dir_lock(folder):
        save(folder, 10)
    assert ck._key(str(folder)) not in ck._held
    assert training.read_meta(os.path.join(folder, "step-000000010.ckpt"))["step"] == 10


def test_disk_full_is_one_clear_error_and_keeps_the_previous_checkpoint(three, monkeypatch):
    folder, newest = three
    real_fdopen = os.fdopen

    class Full:
        """A file on a disk with 300 bytes left."""

        def __init__(self, f):
            self.f, self.left = f, 300

        def write(self, data):
            if len(data) > self.left:
                self.f.write(bytes(data)[:self.left])
                self.left = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
    with pytest.raises(ck.CheckpointError) as info:
        save(folder, 4)
    monkeypatch.undo()
    message = str(info.value)
    assert message == (f"{folder}: expected to save the checkpoint of step 4, failed: no space "
                       f"left on device; the previous checkpoint {newest} is kept, no temp "
                       f"file left")
    assert info.value.__cause__ is None and info.value.__suppress_context__   # one message
    assert sorted(os.listdir(folder)) == [".lock", "step-000000001.ckpt", "step-000000002.ckpt",
                                          "step-000000003.ckpt"]
    assert training.latest_checkpoint(folder) == newest
    assert_same(training.load_checkpoint(newest, like=state_at(0))[0], state_at(3))


def test_a_v1_checkpoint_still_loads(tmp_path):
    """Written as the v1 save did: magic, JSON header, arrays (no checksum)."""
    path = tmp_path / "step-000000005.ckpt"
    with open(path, "wb") as f:
        f.write(ck.MAGIC_V1 + b"\n" + json.dumps({"step": 5, "position": 1}).encode() + b"\n")
        eqx.tree_serialise_leaves(f, state_at(5))
    assert training.latest_checkpoint(tmp_path) == str(path)
    restored, meta = training.load_checkpoint(path, like=state_at(0))
    assert meta == {"step": 5, "position": 1}
    assert_same(restored, state_at(5))


def test_not_a_checkpoint_names_the_expected_first_line(tmp_path):
    path = tmp_path / "step-000000001.ckpt"
    path.write_bytes(b"PK\x03\x04 zip\n")
    with pytest.raises(ck.CorruptCheckpointError, match=r"expected a polyexec checkpoint \(first "
                       r"line b'polyexec-checkpoint-v2'\), found first line b'PK"):
        training.read_meta(path)


def test_fit_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path):
    """Through `fit` as it stands: the damaged newest checkpoint is reported, the run resumes
    from the one before and ends bit-identical to a run never interrupted."""
    from examples.rnn.model import CharLM, loss_fn

    rng = np.random.default_rng(0)
    data = [(np.arange(int(k)) + int(rng.integers(0, 5))) % 11 + 97
            for k in rng.integers(2, 17, size=16)]
    args = dict(optimizer=optax.adam(3e-3), epochs=1, batch_size=4, buckets=[8, 16],
                verbose=False, seed=3, cache=str(tmp_path / "xla"))

    def model():
        return CharLM(cell="gru", embed=4, hidden=8, key=jax.random.PRNGKey(0))

    full = training.fit(model(), loss_fn, data, **args)
    folder = tmp_path / "ck"
    part = training.fit(model(), loss_fn, data, checkpoint_dir=folder, checkpoint_every=1,
                        max_steps=3, **args)
    assert part.stopped_early and int(part.state.step) == 3
    newest = training.list_checkpoints(folder)[-1]
    assert os.path.basename(newest) == "step-000000003.ckpt"
    os.truncate(newest, os.path.getsize(newest) - 7)
    with pytest.warns(ck.CheckpointWarning, match=r"step-000000003.ckpt: .*truncated.*using the "
                      r"previous intact checkpoint .*step-000000002.ckpt"):
        rest = training.fit(model(), loss_fn, data, checkpoint_dir=folder, **args)
    assert int(rest.state.step) == int(full.state.step) > 3
    assert_same(rest.state, full.state)


def test_a_file_system_without_locks_is_reported_and_saving_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ck.fcntl, "flock", no_locks)
    with pytest.warns(ck.CheckpointWarning, match=rf"{re.escape(str(tmp_path))}: expected a file "
                      r"system with file locks, found none \(No locks available\)"):
        save(tmp_path, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once per folder, not at every save
        save(tmp_path, 2)
    assert_same(training.load_checkpoint(training.latest_checkpoint(tmp_path),
                                         like=state_at(0))[0], state_at(2))
