"""Plans on disk: saved with the model's arrays, loaded and run by a process without the model
code; bad files are rejected with PolyexecError. Also `Plan.shapes` and `Plan.describe`."""

import hashlib
import inspect
import json
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px
from examples.rnn.model import CharLM, loss_fn, masked_loss_fn
from polyexec._context import binding
from polyexec._trace import walk as _walk

MAGIC = b"POLYEXEC-PLAN\x00"


def forward(model, tokens, lengths):
    """Three outputs with three kinds of shape: scalar, (B, T, 256) and (B, T - 1)."""
    logits = jax.vmap(model)(tokens)
    return loss_fn(model, tokens, lengths), logits, tokens[:, 1:] - tokens[:, :-1]


def masked_forward(model, tokens, lengths):
    """`forward` as plain jax.jit must compute it on a padded batch: the loss masked by hand,
    the per-row outputs' tails (positions beyond each row's length) zero, as the ragged plan
    returns them."""
    _, logits, diffs = forward(model, tokens, lengths)
    keep = jnp.arange(tokens.shape[1]) < lengths[:, None]
    return (masked_loss_fn(model, tokens, lengths), jnp.where(keep[..., None], logits, 0),
            jnp.where(keep[:, 1:], diffs, 0))


def _exact(fn, sizes, *args):
    """``fn`` at the exact size, with valid_length answering the real sizes."""
    with binding({n: jnp.int32(s) for n, s in sizes.items()}, dict(sizes)):
        return fn(*args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    T = px.LengthVar("T", min=2, max=32)
    B = px.LengthVar("B", max=4)
    model = CharLM(cell="gru", embed=4, hidden=8, key=jax.random.PRNGKey(3))
    plan = px.trace(forward, model, px.Spec("B T", jnp.int32),
                    px.Spec("B", jnp.int32, lengths_of="T"))
    assert not plan.reshaping_is_impossible, plan.reason
    path = tmp_path_factory.mktemp("plans") / "charlm.plan"
    plan.save(path)
    return model, plan, path


def _batch(rng, b, t):
    tokens = rng.integers(0, 256, size=(b, t)).astype(np.int32)
    lengths = rng.integers(0, t + 1, size=b).astype(np.int32)
    return tokens, lengths


LOADER = textwrap.dedent("""
    import importlib.abc, sys
    class NoModelCode(importlib.abc.MetaPathFinder):
        # The plan must run without the Python that defined the model.
        def find_spec(self, name, path=None, target=None):
            if name == "examples" or name.startswith("examples."):
                raise ImportError(f"model code imported: {name}")
    sys.meta_path.insert(0, NoModelCode())

    import numpy as np
    import polyexec as px

    plan = px.Plan.load(sys.argv[1])
    run = px.bucketed(plan)
    data = np.load(sys.argv[2])
    out = {}
    for i in range(int(data["n"])):
        loss, logits, diffs = run(data[f"tokens{i}"], data[f"lengths{i}"])
        out[f"loss{i}"], out[f"logits{i}"], out[f"diffs{i}"] = loss, logits, diffs
    out["compiles"] = run.stats.compiles
    out["traces"] = run.traces
    np.savez(sys.argv[3], **out)
    print("loaded", plan, "model code imported:",
          any(m.startswith("examples") for m in sys.modules))
""")


def test_saved_plan_runs_in_a_fresh_process_without_the_model_code(saved, tmp_path):
    model, plan, path = saved
    rng = np.random.default_rng(0)
    shapes = [(2, 5), (3, 17), (1, 2), (4, 32)]   # buckets (B, T): (2, 8), (4, 32), (1, 2), (4, 32)
    batches = [_batch(rng, b, t) for b, t in shapes]
    inputs = {"n": len(batches)}
    for i, (tokens, lengths) in enumerate(batches):
        inputs[f"tokens{i}"], inputs[f"lengths{i}"] = tokens, lengths
    np.savez(tmp_path / "in.npz", **inputs)
    done = subprocess.run([sys.executable, "-c", LOADER, str(path), str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model code imported: False" in done.stdout
    out = np.load(tmp_path / "out.npz")
    exact = jax.jit(masked_forward)
    for i, ((b, t), (tokens, lengths)) in enumerate(zip(shapes, batches)):
        loss, logits, diffs = _exact(exact, {"B": b, "T": t}, model, tokens, lengths)
        # Ragged outputs come back at the longest real row (the input may be wider).
        n = int(lengths.max())
        assert out[f"logits{i}"].shape == (b, n, 256) and out[f"diffs{i}"].shape == (b, n - 1)
        np.testing.assert_allclose(out[f"loss{i}"], loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[f"logits{i}"], logits[:, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[f"diffs{i}"], diffs[:, :n - 1])
    # One program, compiled once per bucket used (three buckets), never traced in Python.
    assert int(out["traces"]) == 0
    assert int(out["compiles"]) == 3


def test_loaded_plan_in_process_matches_and_checks_its_inputs(saved):
    model, plan, path = saved
    loaded = px.Plan.load(path)
    assert [(v.name, v.min, v.max) for v in loaded.variables] == [("B", 1, 4), ("T", 2, 32)]
    run = px.Bucketed.from_plan(loaded)
    tokens, lengths = _batch(np.random.default_rng(1), 3, 9)
    loss, logits, diffs = run(tokens, lengths)
    ref = _exact(jax.jit(masked_forward), {"B": 3, "T": 9}, model, tokens, lengths)
    np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
    np.testing.assert_allclose(logits, ref[1][:, :int(lengths.max())], rtol=1e-5, atol=1e-5)
    with pytest.raises(px.LengthOverflowError) as info:
        run(np.zeros((2, 33), np.int32), np.zeros(2, np.int32))
    # Paths count the caller's arguments (tokens, lengths), not the stored model arrays.
    assert str(info.value) == ("args[0].shape[1] = 33 is above T's max=32 "
                               "(LengthVar('T', min=2, max=32))")
    with pytest.raises(px.SpecError) as info:
        run(tokens, np.full(3, 10, np.int32))
    assert str(info.value) == "args[1][0] = 10: lengths of 'T' must be <= args[0].shape[1] = 9"
    with pytest.raises(px.SpecError) as info:
        run(tokens)
    assert str(info.value) == "plan forward: expected 2 positional arguments, received 1"


def test_non_polymorphic_plan_cannot_be_saved(tmp_path):
    T = px.LengthVar("T", min=2, max=32)
    plan = px.trace(lambda x: x * (1.0 / int(x.shape[0])), px.Spec("T", jnp.float32))
    with pytest.raises(px.PolyexecError, match=r"cannot save plan <lambda>: reshaping is "
                                               r"impossible, so there is no size-independent "
                                               r"program"):
        plan.save(tmp_path / "x.plan")
    assert not (tmp_path / "x.plan").exists()


# -- bad files ---------------------------------------------------------------------------------

def _split(data: bytes):
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    return json.loads(data[start:start + n]), data[start + n:]


def _forge(header, payload):
    """A file whose checksum is right for ``payload``: only the parsers can reject it."""
    header = dict(header, sha256=hashlib.sha256(payload).hexdigest())
    blob = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(blob)) + blob + payload


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]


def _bad_files(data: bytes):
    header, payload = _split(data)
    body = len(data) - len(payload)
    rng = np.random.default_rng(7)
    program = header["program"]["length"]
    return {
        "truncated in the payload": (data[: len(data) // 2], "checksum mismatch"),
        "truncated in the header": (data[: len(MAGIC) + 20], "truncated: header says"),
        "truncated in the length": (data[: len(MAGIC) + 3], "truncated header"),
        "empty": (b"", "wrong magic bytes (not written by Plan.save)"),
        "flipped byte in the program": (_flip(data, body + program // 2), "checksum mismatch"),
        "flipped byte in the constants": (_flip(data, len(data) - 10), "checksum mismatch"),
        "flipped byte in the header": (_flip(data, len(MAGIC) + 8), "unreadable header"),
        "wrong magic": (b"POLYEXEC-PLAM\x00" + data[len(MAGIC):], "wrong magic bytes"),
        "random garbage": (rng.bytes(4096), "wrong magic bytes"),
        "pickle": (b"\x80\x04\x95" + rng.bytes(64), "wrong magic bytes"),
        "garbage with the magic": (MAGIC + rng.bytes(4096), "truncated: header says"),
        "future format": (_forge(dict(header, format=99), payload), "unsupported format 99"),
        "garbage program, valid checksum": (_forge(header, rng.bytes(len(payload))),
                                            "unreadable program"),
        # A whole span: one flipped byte can land in a location string, which parses.
        "corrupt program, valid checksum": (_forge(header, payload[:program // 2]
                                                   + bytes(b ^ 0x5A for b in payload[program // 2:program // 2 + 64])
                                                   + payload[program // 2 + 64:]),
                                            "unreadable program"),
        "constants beyond the payload": (
            _forge(dict(header, constants=[{"offset": 0, "length": 4, "dtype": "<f4",
                                            "shape": [10 ** 6]}]), payload),
            "inconsistent header (ValueError: buffer is smaller than requested size)"),
        "object constants": (
            _forge(dict(header, constants=[{"offset": 0, "length": 8, "dtype": "|O",
                                            "shape": [1]}]), payload), "inconsistent header"),
        "header missing a field": (_forge({k: v for k, v in header.items() if k != "variables"},
                                          payload), "inconsistent header (KeyError: 'variables')"),
    }


def test_bad_plan_files_raise_polyexec_error(saved, tmp_path):
    _, _, path = saved
    data = path.read_bytes()
    for name, (blob, message) in _bad_files(data).items():
        bad = tmp_path / "bad.plan"
        bad.write_bytes(blob)
        with pytest.raises(px.PolyexecError) as info:
            px.Plan.load(bad)
        text = str(info.value)
        assert text.startswith(f"{bad} is not a valid polyexec plan file: "), (name, text)
        assert message in text, (name, text)
    # The good file still loads (the checks above are not just rejecting everything).
    assert px.Plan.load(path).name == "forward"


def test_bad_plan_files_never_crash_the_process(saved, tmp_path):
    """A crash in native code (a segfault) would kill pytest itself; run the loads in a child
    and require a clean exit with PolyexecError for every file."""
    _, _, path = saved
    names = []
    for i, (name, (blob, _)) in enumerate(_bad_files(path.read_bytes()).items()):
        (tmp_path / f"{i}.plan").write_bytes(blob)
        names.append(str(tmp_path / f"{i}.plan"))
    code = textwrap.dedent("""
        import sys, polyexec as px
        for p in sys.argv[1:]:
            try:
                px.Plan.load(p)
            except px.PolyexecError:
                continue
            sys.exit(f"{p} loaded without error")
        print("all rejected")
    """)
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "all rejected"


# -- shapes and describe -------------------------------------------------------------------------

def mixed(w, x, lengths):
    mask = px.sequence_mask(lengths, x, axis=1)
    h = jnp.tanh(jnp.einsum("btd,de->bte", x, w))
    c = jnp.cumsum(h, axis=1)
    d = c[:, 1:] - c[:, :-1]
    m = jnp.sum(jnp.where(mask[..., None], h, 0.0), axis=1) / jnp.maximum(lengths, 1)[:, None]
    return m, d


def _mixed_plan():
    T = px.LengthVar("T", min=2, max=64)
    B = px.LengthVar("B", max=8)
    w = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    plan = px.trace(mixed, w, px.Spec("B T 3", jnp.float32),
                    px.Spec("B", jnp.int32, lengths_of="T"))
    return w, plan


@pytest.mark.parametrize("b, t", [(2, 7), (1, 2), (8, 64)])
def test_shapes_at_given_sizes_match_the_real_run(b, t):
    w, plan = _mixed_plan()
    x = np.ones((b, t, 3), np.float32)
    lengths = np.full(b, t, np.int32)
    real = jax.make_jaxpr(lambda *a: _exact(mixed, {"B": b, "T": t}, *a))(w, x, lengths)
    shapes = plan.shapes(B=b, T=t)
    inputs = [i for i in shapes if i.primitive == "input"]
    assert [i.shapes[0] for i in inputs] == [(3, 5), (b, t, 3), (b,), (), ()]
    assert [i.where for i in inputs] == ["args[0]", "args[1]", "args[2]", "valid_length(B)",
                                         "valid_length(T)"]
    # Primitive by primitive, the shapes predicted without running equal the traced ones.
    # (The symbolic program slices with `gather` where the concrete one uses `slice`.)
    for primitive in ["iota", "lt", "dot_general", "tanh", "cumsum", "sub", "select_n",
                      "reduce_sum", "div"]:
        predicted = [i.shapes for i in shapes if i.primitive == primitive]
        traced = [tuple(tuple(v.aval.shape) for v in e.outvars) for e in _walk(real.jaxpr)
                  if e.primitive.name == primitive]
        assert predicted and predicted == traced, (primitive, predicted, traced)
    m, d = mixed(w, x, lengths)
    assert plan.output_shapes(B=b, T=t) == [m.shape, d.shape] == [(b, 5), (b, t - 1, 5)]
    # Where each value is computed: the einsum is on its own line of `mixed`.
    lines, start = inspect.getsourcelines(mixed)
    einsum_line = start + next(i for i, s in enumerate(lines) if "einsum" in s)
    (dot,) = [i for i in shapes if i.primitive == "dot_general"]
    assert dot.where.startswith(f"{inspect.getsourcefile(mixed)}:{einsum_line}")


def test_describe_shows_the_symbolic_program():
    _, plan = _mixed_plan()
    text = plan.describe()
    lines = text.splitlines()
    assert lines[0].startswith("Plan mixed: size-independent, traced once over B in [1, 8], "
                               "T in [2, 64]; ")
    assert lines[1] == "inputs:"
    assert lines[2].split() == ["args[0]", "float32[3,5]"]
    assert lines[3].split() == ["args[1]", "float32[B,T,3]"]
    assert lines[4].split() == ["args[2]", "int32[B]"]
    assert "program:" in lines and "outputs:" in lines
    outputs = lines[lines.index("outputs:") + 1:]
    assert [o.split(None, 1) for o in outputs] == [["out[0]", "float32[B,5]"],
                                                   ["out[1]", "float32[B,T - 1,5]"]]
    dot = next(line for line in lines if " dot_general " in line)
    assert "float32[B,T,5]" in dot and "test_plan_file.py:" in dot


def test_describe_of_a_non_polymorphic_plan_gives_the_reason():
    T = px.LengthVar("T", min=2, max=32)
    plan = px.trace(lambda x: x * (1.0 / int(x.shape[0])), px.Spec("T", jnp.float32))
    assert plan.describe().startswith("Plan <lambda>: RESHAPING IMPOSSIBLE — ")
    assert plan.reason in plan.describe()
    with pytest.raises(px.PolymorphismError):
        plan.shapes(T=4)
