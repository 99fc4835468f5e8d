"""Training across processes on JAX's distributed runtime: two processes on localhost (one CPU
device each, gradients all-reduced over gloo) against one process on the same data."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 rows per process: the two-process global batch is the one-process run's 16 rows.
# One length bucket: two compiles (train, eval) per run, the resumed run loads them from cache.
TINY = ["--limit", "120", "--hidden", "16", "--embed", "8", "--cap", "48", "--buckets",
        "fixed:48", "--samples", "0", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path):
    # A wide console: rich wraps long lines (a checkpoint's path) wherever the width falls.
    env = dict(os.environ, JAX_PLATFORMS="cpu", HOME=str(tmp_path / "home"),
               XDG_CACHE_HOME=str(tmp_path / "xdg"), COLUMNS="400")
    env.pop("XLA_FLAGS", None)          # one CPU device per process
    env.pop("POLYEXEC_CACHE_DIR", None)
    return env


def _launch(args, tmp_path, name):
    out = open(tmp_path / f"{name}.out", "w")
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "examples.rnn.train", *args], cwd=ROOT,
                            env=_env(tmp_path), stdout=out, stderr=err)


def _two_processes(args, tmp_path, name):
    port = _free_port()
    procs = [_launch([*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                      "--process-id", str(i)], tmp_path, f"{name}{i}") for i in range(2)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"{name}{i}.err").read_text()[-3000:]
    return [(tmp_path / f"{name}{i}.out").read_text() for i in range(2)]


def _val_losses(path) -> list[float]:
    return [r["val_loss"] for r in map(json.loads, open(path)) if r["kind"] == "epoch"]


def test_two_processes_train_like_one_and_resume_to_the_same_result(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    # Two processes, one epoch, checkpointed; then resumed from that checkpoint to two epochs.
    first, quiet = _two_processes([*TINY, *cache, "--epochs", "1", "--batch-size", "8",
                                   "--checkpoint-dir", str(tmp_path / "ck"),
                                   "--metrics", str(tmp_path / "two.jsonl")], tmp_path, "a")
    _two_processes([*TINY, *cache, "--epochs", "2", "--batch-size", "8",
                    "--checkpoint-dir", str(tmp_path / "ck"),
                    "--metrics", str(tmp_path / "two.jsonl")], tmp_path, "b")
    # One process, the same global batches, two epochs without a break.
    single = subprocess.run([sys.executable, "-m", "examples.rnn.train", *TINY, *cache,
                             "--epochs", "2", "--batch-size", "16",
                             "--metrics", str(tmp_path / "one.jsonl")],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

    assert "devices: 2 (cpu" in first and "validation loss:" in first
    # Only process 0 reports (gloo itself still says it connected).
    assert "corpus:" not in quiet and "validation loss" not in quiet, quiet
    two, one = _val_losses(tmp_path / "two.jsonl"), _val_losses(tmp_path / "one.jsonl")
    assert len(two) == len(one) == 2, (two, one)
    assert two == pytest.approx(one, abs=2e-3)
    assert abs(one[1] - one[0]) > 1e-2, "the second epoch must change the loss for this to test"
    assert len(os.listdir(tmp_path / "ck")) >= 1


def _step_losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "step"]


def test_two_processes_train_packed_rows_like_one_and_resume_mid_epoch(tmp_path):
    """``--layout pack``: every process plans the same global packed steps and loads only the
    examples packed into its half of the rows (--max-tokens is per process, as --batch-size
    is): the grid is the one a single process with twice the budget runs, 16 rows of 48.
    Killed once its step-3 checkpoint is written and resumed from it, the two-process run
    ends where one uninterrupted process does."""
    packed = [*TINY[:TINY.index("--buckets")], *TINY[TINY.index("--buckets") + 2:],
              "--layout", "pack", "--epochs", "1", "--no-cache"]
    two = [*packed, "--max-tokens", "384", "--checkpoint-dir", str(tmp_path / "ck"),
           "--checkpoint-every", "3", "--metrics", str(tmp_path / "two.jsonl")]
    (tmp_path / "ck").mkdir()
    port = _free_port()
    procs = [_launch([*two, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                      "--process-id", str(i)], tmp_path, f"killed{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not any(n.startswith("step-") for n in os.listdir(tmp_path / "ck")):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                (tmp_path / "killed0.err").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    first, quiet = _two_processes(two, tmp_path, "resumed")
    single = subprocess.run([sys.executable, "-m", "examples.rnn.train", *packed,
                             "--max-tokens", "768", "--metrics", str(tmp_path / "one.jsonl")],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    # Resumed mid-epoch, at the checkpoint's global rows (every process's, not one's share).
    first = " ".join(first.split())            # the console wraps long lines
    assert re.search(r"\.ckpt: step \d, epoch 1, batch [1-6]\b", first), first
    assert "the checkpoint's packed rows, {'48': 16}" in first, first
    assert "layout pack (16 rows of 48)" in single.stdout, single.stdout
    assert "validation loss" not in quiet, quiet
    two, one = _step_losses(tmp_path / "two.jsonl"), _step_losses(tmp_path / "one.jsonl")
    assert len(two) == len(one) > 4, (two, one)
    assert two == pytest.approx(one, rel=1e-5)
    assert one[-1] < one[0] - 0.1, "the steps must change the loss for this to test"
    val_two, val_one = _val_losses(tmp_path / "two.jsonl"), _val_losses(tmp_path / "one.jsonl")
    assert len(val_two) == 1 and val_two == pytest.approx(val_one, rel=1e-5)


def test_a_dead_process_ends_the_other_with_a_message(tmp_path):
    port = _free_port()
    args = [*TINY, "--epochs", "50", "--batch-size", "8", "--no-cache", "--heartbeat-timeout",
            "5", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    survivor = _launch([*args, "--process-id", "0"], tmp_path, "p0")
    victim = _launch([*args, "--process-id", "1"], tmp_path, "p1")
    try:
        deadline = time.monotonic() + 240
        while "warmup:" not in (tmp_path / "p0.out").read_text():      # training starts
            assert survivor.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = survivor.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - killed < 30        # the heartbeat timeout is 5 s
        err = (tmp_path / "p0.err").read_text()
        assert ("another process of the run has probably died" in err
                or "heartbeat timeout" in err), err[-3000:]
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()


def test_two_processes_pack_the_steps_of_one_under_batch_size(tmp_path):
    """``--batch-size 8`` in each of two processes plans the packed steps that ``--batch-size
    16`` plans in one, even where the rows those steps need do not split over the two devices:
    the grid takes an empty row then, the steps stay the same."""
    packed = [*TINY[:TINY.index("--buckets")], *TINY[TINY.index("--buckets") + 2:],
              "--layout", "pack", "--epochs", "1", "--no-cache"]
    _two_processes([*packed, "--batch-size", "8", "--metrics", str(tmp_path / "two.jsonl")],
                   tmp_path, "two")
    single = subprocess.run([sys.executable, "-m", "examples.rnn.train", *packed,
                             "--batch-size", "16", "--metrics", str(tmp_path / "one.jsonl")],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = _step_losses(tmp_path / "two.jsonl"), _step_losses(tmp_path / "one.jsonl")
    assert len(two) == len(one) > 4, (two, one)
    assert two == pytest.approx(one, rel=1e-5)
    assert _val_losses(tmp_path / "two.jsonl") == pytest.approx(
        _val_losses(tmp_path / "one.jsonl"), rel=1e-5)


def test_an_unreachable_coordinator_fails_after_the_stated_timeout_with_a_message(tmp_path):
    """Process 1 of a run whose process 0 never started: before, it waited without a word (and
    JAX's client later aborted it blaming "another task"). Now it gives up after
    --coordinator-timeout seconds with one line naming the address; nothing hangs."""
    port = _free_port()                   # closed: nothing listens there
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "examples.rnn.train", *TINY, "--coordinator",
                           f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                           "--coordinator-timeout", "2"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    waited = time.monotonic() - started
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error == (f"python -m examples.rnn.train: error: coordinator 127.0.0.1:{port}: "
                     f"expected process 0's coordinator listening there, received no connection "
                     f"within 2 s (Connection refused); start process 0 with the same coordinator "
                     f"address, check the host and port, or allow longer (the example's "
                     f"--coordinator-timeout, initialize_distributed's timeout)"), error
    assert waited < 60, waited             # about 2 s and an interpreter's start
