"""The calling convention: one order of a program's flat inputs, asked by every stage."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from jax import export

import polyexec as px
from polyexec._bind import bind
from polyexec._convention import Convention
from polyexec._spec import symbolic_dims

T = px.LengthVar("T", min=2, max=64)
B = px.LengthVar("B", max=8)
K = px.LengthVar("K", max=64)
VARIABLES = {"T": T, "B": B}


@given(n_fixed=st.integers(0, 3), n_poly=st.integers(1, 3), t=st.integers(2, 64),
       b=st.integers(1, 8))
def test_assemble_then_split_gives_back_every_part(n_fixed, n_poly, t, b):
    args = [np.full((i + 1,), i, np.float32) for i in range(n_fixed)]
    args += [np.full((b, t), 10 + i, np.float32) for i in range(n_poly)]
    specs = [None] * n_fixed + [px.Spec("B T", jnp.float32)] * n_poly
    call = bind(tuple(args), tuple(specs), VARIABLES)
    handed = [np.zeros(3, np.float32)]
    convention = Convention.of(call.signature, [T, B], [("cut K: values[0]", ("K",), np.float32)])
    flat = convention.assemble(arrays=call.arrays, poly=call.poly, handed=handed, sizes=call.sizes)
    assert len(flat) == len(convention.slots) == n_fixed + n_poly + 1 + 2
    parts = convention.split(flat)
    assert [a.tolist() for a in parts.arrays] == [a.tolist() for a in args[:n_fixed]]
    assert [p.tolist() for p in parts.poly] == [p.tolist() for p in args[n_fixed:]]
    assert parts.handed == handed and parts.sizes == {"T": t, "B": b}
    assert [flat[i] for i in convention.sizes_at.values()] == [t, b]
    restored = call.signature.unflatten(parts.arrays, parts.poly)
    assert all(np.array_equal(x, y) for x, y in zip(restored, args))


def test_avals_are_symbolic_or_concrete_and_handed_dims_follow_their_scope():
    call = bind((np.ones((2, 5), np.float32),), (px.Spec("B T", jnp.float32),), VARIABLES)
    # A value handed over with an earlier segment's dimension (T - 1) and the cut's K.
    (earlier_t,) = export.symbolic_shape("T", constraints=["T <= 64", "T >= 2"])
    convention = Convention.of(call.signature, [B, T, K],
                               [("cut K: values[0]", ("K", earlier_t - 1), np.float32)])
    symbolic = convention.avals(symbolic_dims([B, T, K]))
    assert [str(d) for d in symbolic[1].shape] == ["K", "T - 1"]
    assert symbolic[1].shape[1].scope is symbolic[0].shape[0].scope
    concrete = convention.avals({"B": 4, "T": 16, "K": 8})
    assert [a.shape for a in concrete] == [(4, 16), (8, 15), (), (), ()]
    assert convention.paths == ("args[0]", "cut K: values[0]", "valid_length(B)",
                                "valid_length(T)", "valid_length(K)")


def test_donation_and_shardings_are_per_argument():
    model, tokens = np.ones(3, np.float32), np.ones((2, 5), np.int32)
    call = bind((model, tokens, model * 2), (None, px.Spec("B T", jnp.int32), None), VARIABLES)
    convention = Convention.of(call.signature, [B, T])
    assert convention.donated([0]) == (0,) and convention.donated([2]) == (1,)
    assert convention.donated([1]) == ()     # Spec'd inputs are host copies, never donated
