"""Logical-length execution: rewrite the symbolic program so padding never changes a result.

polyexec traces a function once with symbolic lengths (``T``, ``B``) and runs that one program
at every bucket: each symbolic dimension is bound to the bucket's (physical) size while the real
(pre-padding) size of each length variable arrives as an int32 scalar input. Plain JAX code
that does not mask -- ``jnp.mean(x, 0)``, softmax, ``jnp.flip``, ``x[-1]``, a scan's final
carry, attention, ``x.shape[0]`` used as a value -- would silently compute over the padding.
`rewrite` turns the traced program into its *logical* program, once, equation by equation.

The invariant
-------------
Every axis whose size is a symbolic dimension expression ``d`` (a *length axis*) has a logical
length: ``d`` evaluated at the real sizes (``T`` -> t, ``T - 1`` -> t - 1, ``2*T`` -> 2t).
**Values beyond the logical length of any axis are "don't care"** (inputs' padding may hold
NaN/inf, and so may anything computed from it). Each rule guarantees that the logical
positions of its outputs are computed from logical positions of its inputs only, exactly as the
same primitive computes them at the exact size. By induction the logical prefix of every program
output equals the exact-size result; the caller slices outputs back to their logical lengths.

Masks are ``select``s on ``iota < logical_length`` -- never a multiply, since ``0 * inf`` is
NaN -- and are only built where an equation actually reads across a length axis, so a program
with no length-sensitive operation is left as it is. A value that a contraction or a sum reads
across a length axis is zeroed once, where it is made, and all its readers take that value
(its tail is "don't care" to the others): a masked copy beside the unmasked one cost XLA a
second buffer for every weight gradient's operand.

The interpreter and the layouts
-------------------------------
One interpreter (`_core.eval_jaxpr`, one step `_core.evaluate` per equation) runs every
layout. Each variable's value has one annotation beside it (`_basics.Known`: the axes already
zeroed, whether it is made from lengths alone, or from positions alone), which the step hands
a rule by position (``ctx.operands[i]``, as JAX's batching hands a rule its operands' ``dims``)
and a rule may state for its outputs (``ctx.results``: a call's, from its program); nothing is
looked up by the value's identity. A value held in a layout's own form -- per row of ragged
rows, per sequence or per cell of packed rows -- is a plain array so annotated, and one that
cannot be packed is None so annotated: no wrapper object stands in a value's place. The step
asks the layout, which is the evaluation context (`_core.Ctx` for padded and ragged rows,
`_packed.PackedCtx` for packed ones), what differs: how it evaluates a held value, what it
refuses whatever the rule, its rule for a primitive, and what a refused equation gives.

Rules, by family (each registered next to its definition, like JAX's batching rules)
-------------------------------------------------------------------------------------
One registry (`_registry`: one `Entry` per primitive) holds each primitive's rule in every layout
-- padded (and ragged) rows, packed rows, a value held per sequence or per cell in packed
rows -- and its
facts, stated beside its padded rule with ``defrule``: what it moves (flagged on ragged rows),
the window it reads (the shortest row it fits), the length axes it reads with zeroed tails,
what it acts on (per-sequence values run per column through the rest). The interpreter asks
the entry; no module switches on primitive names for these. `_families` states each
combining family's identity once (reducers, cumulative ops, windows, scatters).

A family's rule is written once for both layouts (``defrule(..., layout=PAD_AND_PACK)``), as
JAX's ``defreducer`` writes one batching rule for every batch dimension: the rule says which
operands, identities and axes; the layout does what differs (`Ctx.reduce`, `Ctx.accumulate`,
`Ctx.window`, `Ctx.reverse`): padded rows put the identity in each row's tail, packed rows
combine, or reverse, within each sequence. The other primitives have a padded and a packed
rule each in the same entry, both in the primitive's family module, the packed one below the
padded ones (as JAX keeps every batching rule beside its primitive): one file to read, or to
change, for a primitive in every layout.

- `_pointwise`: elementwise and layout primitives pass through; ``dim_as_value``.
- `_reductions`: reductions and cumulative ones (the layout combines with the identity).
- `_structure`: ``rev``, ``tile``, ``sort``, ``top_k``, ``reshape``, ``slice``, ``split``,
  ``concatenate``, ``pad``.
- `_indexing`: ``dynamic_slice``, ``dynamic_update_slice``, ``gather``, ``scatter*``.
- `_contractions`: ``dot_general``, ``conv_general_dilated``, ``reduce_window*``,
  ``select_and_{scatter,gather}_add``.
- `_control`: ``scan``, ``while``, ``cond`` and the call-likes (structural: they recurse).
- `_random`: ``random_bits`` shaped by a length (dropout): every real cell draws JAX's
  partitionable threefry at its flat index in the exact-size shape, so its bits are those
  ``jax.jit`` draws on the exact-size input, in every bucket and layout (packed rows: by its
  sequence's index in the call and its position).
- `_packed` (`rewrite_packed`, ``layout="pack"``) and `_sequences` (its per-sequence values):
  the packed layout's machinery only -- its context (`_packed.PackedCtx`: the frame, the
  family operations within each sequence), the helpers the packed rules share, and the
  per-sequence interpreter; they register no rule.
- `_interface`: what a rule may ask of its layout (`Layout`, `PackedLayout`), declared once;
  `_core.Ctx` and `_packed.PackedCtx` implement it.
- `_core`: the evaluation context, the interpreter, `rewrite`; `_registry`: the one table,
  `defrule`, and `register_rule` (``px.register_rule``), which adds a rule for a primitive
  polyexec does not know; `_basics`: dimensions and values every rule uses.
  JAX's internals are read through `polyexec._jax_internals` only.

An equation that touches a length axis (an aval or a parameter holds a symbolic dimension) and
has no rule is recorded as `Unsupported` with the user's line, and runs unchanged. So is one
whose result has a length that can exceed its bucket size (``16 - T``): such a value has no
room for its logical positions.
"""

# The families register their rules as they are imported; `rewrite` is only reachable through
# this package, so it always sees the full registry.
from . import (_contractions, _control, _indexing, _pointwise, _random,  # noqa: F401
               _reductions, _structure)
from ._core import Logical, RowFloor, Unsupported, rewrite
from ._registry import RuleContext, register_rule
from ._packed import rewrite_packed

__all__ = ["Logical", "RowFloor", "RuleContext", "Unsupported", "register_rule", "rewrite", "rewrite_packed"]
