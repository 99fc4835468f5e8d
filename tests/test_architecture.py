"""The core's shape: an acyclic import graph, immutable plans, names decided locally."""

import ast
import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px
from polyexec._logical._core import Ctx, Recorder
from polyexec._logical._interface import Layout, PackedLayout
from polyexec._logical._packed import Grid, PackedCtx
from polyexec._logical._registry import Entry

PACKAGE = pathlib.Path(px.__file__).parent
# Imports allowed inside functions: optional dependencies only.
OPTIONAL = {"hypothesis", "matplotlib"}


def import_graph() -> dict[str, set[str]]:
    """module -> polyexec modules it imports, from the AST (imports inside functions too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t.startswith("polyexec") and t != name}
        graph[name] = edges
    modules = set(graph)
    return {m: {t for t in edges if t in modules} for m, edges in graph.items()}


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_import_graph_of_the_core_is_acyclic():
    graph = import_graph()
    # Importing the package from its modules would hide a cycle behind __init__: drop only the
    # edges *into* the package root, which every submodule import passes through.
    core = {m: {t for t in e if t != "polyexec"} for m, e in graph.items()}
    assert "polyexec._executor" in core and "polyexec._plan" in core
    assert find_cycle(core) is None, f"import cycle: {' -> '.join(find_cycle(core))}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_imports_inside_functions_except_optional_dependencies():
    hidden = []
    for path in PACKAGE.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                        [a.name for a in node.names]
                    if not all(n.split(".")[0] in OPTIONAL for n in names):
                        hidden.append(f"{path.name}:{node.lineno} in {fn.name}: {names}")
    assert not hidden, hidden


def test_plans_refuse_attribute_assignment():
    T = px.LengthVar("T", max=16)
    plan = px.trace(lambda x: jnp.cumsum(x), px.Spec("T", jnp.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reason = "changed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.out_tree = None
    K = px.LengthVar("K", max=16)

    def filtered(x):
        kept, _ = px.compact(x, x > 0, length=K)
        return kept * 2

    partitioned = px.trace(filtered, px.Spec("T", jnp.float32))
    assert type(partitioned) is type(plan) and len(partitioned.segments) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        partitioned.segments = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        partitioned.segments[0].cut = None


def test_slow_path_leaves_its_plan_unchanged():
    T = px.LengthVar("T", max=32)

    def prefix_sums(x):
        return jnp.stack([jnp.sum(x[: t + 1]) for t in range(x.shape[0])])

    f = px.bucketed(prefix_sums, in_specs=(px.Spec("T", jnp.float32),), out_specs=px.Spec("T"),
                    buckets={T: [4, 8, 32]})
    with pytest.warns(UserWarning, match="not shape-polymorphic"):
        f(np.ones(3, np.float32))
    plan = f.plan
    before = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)}
    for t in (3, 7, 20):
        np.testing.assert_allclose(f(np.arange(t, dtype=np.float32)),
                                   np.cumsum(np.arange(t, dtype=np.float32)))
    assert f.plan is plan and f.stats.compiles == 3
    after = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)}
    assert after == before


@pytest.mark.parametrize("order", ["small first", "large first"])
def test_two_functions_with_the_same_variable_name_and_different_bounds(order):
    def make(limit):
        T = px.LengthVar("T", max=limit)
        return px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T", jnp.float32),),
                           out_specs=px.Spec("T"))

    limits = [8, 64] if order == "small first" else [64, 8]
    made = {limit: make(limit) for limit in limits}
    px.LengthVar("T", max=4)   # a later definition changes nothing that exists
    np.testing.assert_array_equal(made[64](np.ones(40, np.float32)), np.full(40, 2.0))
    with pytest.raises(px.LengthOverflowError, match="above T's max=8"):
        made[8](np.ones(40, np.float32))
    np.testing.assert_array_equal(made[8](np.ones(8, np.float32)), np.full(8, 2.0))


def test_explicit_length_vars_win_over_the_callers_scope():
    T = px.LengthVar("T", max=8)       # noqa: F841 - in scope, but not the one given
    wide = px.LengthVar("T", max=128)
    f = px.bucketed(lambda x: x + 1, in_specs=(px.Spec([wide], jnp.float32),),
                    out_specs=px.Spec("T"))
    np.testing.assert_array_equal(f(np.zeros(100, np.float32)), np.ones(100))


def test_a_name_in_scope_twice_is_ambiguous():
    def make():
        short, long = px.LengthVar("T", max=8), px.LengthVar("T", max=64)  # noqa: F841
        return px.bucketed(lambda x: x, in_specs=(px.Spec("T"),))

    with pytest.raises(px.SpecError, match="Spec name 'T' is ambiguous here"):
        make()


# -- compile accounting belongs to its caller ---------------------------------------------------

def _run_python(code: str) -> str:
    import os
    import subprocess
    import sys
    import textwrap

    root = str(PACKAGE.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_polyexec_registers_no_jax_monitoring_listener():
    import json

    out = _run_python("""
        import json
        import jax
        from jax._src import monitoring
        def count():
            return [len(monitoring.get_event_listeners()),
                    len(monitoring.get_event_duration_listeners())]
        seen = {"before": count()}
        import polyexec as px, polyexec.training, buckets
        import bench.strategies, bench.cli, examples.rnn.train
        seen["imported"] = count()
        with px.count_compiles():
            seen["counting"] = count()
        seen["counted"] = count()
        with px.forbid_compiles():
            seen["forbidding"] = count()
        seen["forbidden"] = count()
        print(json.dumps(seen))
    """)
    seen = json.loads(out.splitlines()[-1])
    assert seen["imported"] == seen["before"], f"importing added listeners: {seen}"
    # Counting and forbidding listen for their block only.
    assert seen["counting"] == [seen["before"][0] + 1, seen["before"][1] + 1]
    assert seen["forbidding"] == [seen["before"][0], seen["before"][1] + 1]
    assert seen["counted"] == seen["forbidden"] == seen["before"]


def test_count_compiles_counts_a_real_compile_and_a_cache_hit(tmp_path):
    out = _run_python(f"""
        import json
        import numpy as np, jax.numpy as jnp, polyexec as px
        px.enable_persistent_cache({str(tmp_path)!r})
        T = px.LengthVar("T", max=64)
        def make():
            return px.bucketed(lambda x: jnp.sin(x) * 3.0, in_specs=(px.Spec("T", jnp.float32),),
                               out_specs=px.Spec("T"), buckets={{T: [16, 64]}})
        x = np.ones(10, np.float32)
        with px.count_compiles() as cold:
            make()(x)
        with px.count_compiles() as warm:     # a fresh function: T=16 loads from disk
            make()(x)
        outside = make()
        outside(np.ones(40, np.float32))      # compiled with no counter open: counted nowhere
        print(json.dumps([cold.counts().as_dict(), warm.counts().as_dict()]))
    """)
    cold, warm = __import__("json").loads(out.splitlines()[-1])
    assert cold["xla_compiles"] >= 1 and cold["cache_hits"] == 0 and cold["cache_writes"] >= 1
    assert cold["backend_seconds"] > 0
    assert warm["cache_hits"] >= 1 and warm["xla_compiles"] == 0
    assert warm["xla_compiles"] == warm["backend_compiles"] - warm["cache_hits"]


def test_a_counter_cannot_be_entered_twice_at_once():
    events = px.count_compiles()
    with events:
        with pytest.raises(px.PolyexecError, match="CompileEvents: expected a counter that is "
                                                   "not counting already"):
            with events:
                pass


# -- clients use the public surface ----------------------------------------------------------------

CLIENTS = ("bench", "examples", "buckets")


def private_polyexec_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a private polyexec module (a dotted part starting
    with ``_``: ``polyexec._bind``, ``from polyexec import _cache``, ``polyexec.training._data``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "polyexec" and any(p.startswith("_") for p in parts[1:]):
                found.append((node.lineno, name))
                break
    return found


def test_private_import_finder_finds_every_form():
    code = ("import polyexec._cache\nfrom polyexec._bind import pad_to\nfrom polyexec import _errors\n"
            "from polyexec.training._data import Batching\nimport polyexec as px\n"
            "from polyexec import training\nfrom polyexec.training import fit\n")
    assert [line for line, _ in private_polyexec_imports(code)] == [1, 2, 3, 4]


def test_clients_import_no_private_polyexec_module():
    root = PACKAGE.parent
    files = [p for d in CLIENTS for p in (root / d).rglob("*.py")]
    assert any(p.parts[-2] == "bench" for p in files) and any("examples" in p.parts for p in files)
    private = [f"{p.relative_to(root)}:{line}: {name}" for p in files
               for line, name in private_polyexec_imports(p.read_text())]
    assert not private, "clients must use polyexec's public surface:\n" + "\n".join(private)


# -- JAX's private API is read in one module ------------------------------------------------------

JAX_INTERNALS = PACKAGE / "_jax_internals.py"
# Private attributes of JAX's symbolic dimensions (shape_poly._DimExpr and its terms, factors).
PRIVATE_DIM_ATTRIBUTES = {"_get_vars", "_evaluate", "_sorted_terms", "_from_var",
                          "_bounds_decision", "_DimExpr", "_DimFactor", "_factors"}


def jax_internal_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every import of ``jax._src`` (``import``, ``from ... import``,
    ``from jax import _src``, ``jax._src.x`` as an attribute, ``importlib.import_module``) and
    every read of a private attribute of a symbolic dimension (``d._get_vars()``,
    ``getattr(d, "_evaluate")``, an imported ``_DimExpr``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[:2] == ["jax", "_src"]]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [a.name for a in node.names]
            if (node.module.split(".")[:2] == ["jax", "_src"]
                    or (node.module == "jax" and "_src" in names)
                    or PRIVATE_DIM_ATTRIBUTES & set(names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Attribute) and (node.attr == "_src"
                                                  or node.attr in PRIVATE_DIM_ATTRIBUTES):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[-1], ast.Constant):
            callee = getattr(node.func, "attr", getattr(node.func, "id", ""))
            text = node.args[-1].value
            if ((callee in ("import_module", "__import__") and str(text).startswith("jax._src"))
                    or (callee in ("getattr", "hasattr") and text in PRIVATE_DIM_ATTRIBUTES)):
                found.append((node.lineno, f"{callee}({text!r})"))
    return sorted(found)


def test_only_the_adapter_reads_jax_internals():
    # A JAX release may change any private name; reading them in one module keeps the mending
    # of such a break in one place (polyexec/_jax_internals.py).
    forms = ("from jax._src import core\nimport jax._src.core as c\nfrom jax import _src\n"
             "jax._src.core.is_constant_dim(1)\nd._get_vars()\nd._evaluate({})\n"
             "x = d._sorted_terms\nt._factors\nshape_poly._DimExpr._from_var('T', s)\n"
             "from jax._src.export.shape_poly import _DimFactor\ngetattr(d, '_evaluate')\n"
             "importlib.import_module('jax._src.core')\nd.scope\nimport jax\n")
    assert sorted({line for line, _ in jax_internal_reads(forms)}) == list(range(1, 13))
    assert JAX_INTERNALS.exists() and jax_internal_reads(JAX_INTERNALS.read_text())
    reads = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != JAX_INTERNALS
             for line, what in jax_internal_reads(path.read_text())]
    assert not reads, ("JAX internals are read only in polyexec/_jax_internals.py; move these "
                       "reads into a shim there:\n" + "\n".join(reads))


def test_no_rule_module_imports_a_siblings_private_names():
    # A rule that needs another layout's rule for the same primitive reaches it through the
    # registry (`padded_rule`), and shared helpers are the package's names: a private import
    # would tie one rule file to another's internals, as before the one-registry rewrite.
    found = []
    for path in sorted((PACKAGE / "_logical").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    found.append(f"{path.name} imports {private} from .{node.module}")
    assert not found, "\n".join(found)


FAMILIES = {"_pointwise", "_reductions", "_structure", "_indexing", "_contractions", "_control",
            "_random"}


def _names(node) -> list[str]:
    """The primitive names an argument holds: a string, or ``*"a b c".split()``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Starred):
        call = node.value
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "split" and isinstance(call.func.value, ast.Constant)):
            return call.func.value.value.split()
    return []


def registrations(functions=("defrule",)) -> dict[str, set[str]]:
    """primitive name -> the `_logical` modules that call one of ``functions`` for it
    (``defrule`` decorators and calls alike, read from the AST)."""
    found: dict[str, set[str]] = {}
    for path in (PACKAGE / "_logical").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in functions):
                for arg in node.args:
                    for name in _names(arg):
                        found.setdefault(name, set()).add(path.stem)
    return found


def test_each_primitives_rules_in_every_layout_live_in_its_family_module():
    """As JAX keeps each batching rule beside its primitive: one family module registers a
    primitive's padded, packed, per-sequence and per-cell rules; the layouts' own modules
    (`_packed`, `_sequences`) are machinery and register none."""
    found = registrations()
    assert {"gather", "scatter-add", "reduce_sum", "conv_general_dilated", "dot_general",
            "concatenate", "scan", "random_bits"} <= set(found)
    for primitive, modules in found.items():
        assert len(modules) == 1 and modules <= FAMILIES, (primitive, modules)


def test_no_module_of_polyexec_is_over_1200_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 1200}
    assert not long, long


def isinstance_of_own_classes(sources: dict[str, str]) -> list[str]:
    """``isinstance`` tests of a class defined in ``sources`` (file name -> text)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    own = {node.name for tree in trees.values() for node in ast.walk(tree)
           if isinstance(node, ast.ClassDef)}
    return [f"{name}:{node.lineno}: {ast.unparse(node)}" for name, tree in trees.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
            and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & own]


def test_rules_tell_a_values_form_by_its_annotation_not_its_class():
    """As JAX's batching hands a rule its operands' batch dimensions by position, the
    interpreter hands a rule its operands' annotations (`Known`: per row, per sequence, per
    cell, not packed); a value held in a layout's own form is a plain array so annotated,
    never a wrapper object told apart with ``isinstance`` (two equations may hand back the
    very same object). Every ``isinstance`` of `_logical` tests JAX's, NumPy's or Python's
    own types."""
    sources = {p.name: p.read_text() for p in sorted((PACKAGE / "_logical").glob("*.py"))}
    assert isinstance_of_own_classes({"wrapped.py": "class Held: pass\n"
                                                    "isinstance(x, (int, Held))\n"})
    assert not isinstance_of_own_classes(sources)


# An entry's facts (its layout slots and bookkeeping aside).
FACTS = {f.name for f in dataclasses.fields(Entry)} - {
    "rule", "packed", "per_sequence", "per_cell", "structural", "origin"}


def test_every_fact_of_a_primitive_is_a_declared_field_stated_beside_its_rule():
    """The interpreter reads a primitive's facts from its registry entry (`defrule`'s or
    `deffacts`' fields), stated in the module that registers its rules: no attributes set on
    rule functions and read back with ``getattr``, and no table keyed by primitive names
    outside the registry and the families' identities (`_families`)."""
    ruled, stated = registrations(), registrations(("deffacts",))
    assert {"add", "reduce_sum", "broadcast_in_dim", "gather", "scan"} <= set(stated)
    for primitive, modules in stated.items():
        assert modules == ruled.get(primitive), (primitive, modules, ruled.get(primitive))
    known = set(ruled)
    found = []
    for path in sorted((PACKAGE / "_logical").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and \
                    "rule" in ast.unparse(node.args[0]):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr in FACTS for t in node.targets):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if path.stem in ("_families", "_registry"):
            continue
        for node in ast.parse(text).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                strings = [w for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str) for w in c.value.split()]
                if len(set(strings) & known) >= 2:
                    found.append(f"{path.name}:{node.lineno}: a table of primitive names")
    assert not found, "\n".join(found)


def test_rules_ask_their_layout_only_through_the_declared_interface():
    """Every ``ctx.<name>`` a family module's rule reads is declared in `Layout` (every layout)
    or `PackedLayout` (packed rows), and each layout's context implements its interface; no
    module-level function reaches into a context's or recorder's private names."""
    declared = {n for n in dir(PackedLayout) if not n.startswith("_")} | set(
        PackedLayout.__annotations__) | set(Layout.__annotations__)
    used, private = set(), []
    for path in sorted((PACKAGE / "_logical").glob("*.py")):
        tree = ast.parse(path.read_text())
        for top in tree.body:
            for node in ast.walk(top):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in ("ctx", "recorder")):
                    continue
                if path.stem in FAMILIES and node.value.id == "ctx":
                    used.add(node.attr)
                if (node.attr.startswith("_") and not node.attr.startswith("__")
                        and not isinstance(top, ast.ClassDef)):
                    private.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert used - declared == set(), used - declared
    assert not private, private
    ctx = Ctx({}, Recorder())
    packed = PackedCtx({}, Recorder(), grids={"T": Grid(None, None, None)}, rows="B", var="T")
    assert isinstance(ctx, Layout) and not isinstance(ctx, PackedLayout)
    assert isinstance(packed, PackedLayout)


# -- the executor asks layouts; clients read no layout's internals ---------------------------------

LAYOUT_NAMES = {"pad", "pack", "auto"}


def layout_names_read(source: str) -> list[tuple[int, str]]:
    """(line, code) of every string constant naming a layout or the ``auto`` option
    (``"pad"``, ``"pack"``, ``"auto"``: a comparison, a ``match`` case, a subscript, an argument
    such as ``program("pack")``) except in the three places the ``layout=`` option is *declared*
    rather than branched on: the ``Literal`` type listing the valid options (what
    ``check_option`` validates against), a parameter's default value (``layout="pad"``), and the
    keys of the one table that maps each option, once, to the layout objects its calls may run
    in (a dict display assigned to a module-level name). Choosing between layouts by cost
    needs no name: it compares the cells the layout objects report."""
    tree = ast.parse(source)
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "Literal"):
            allowed |= {id(c) for c in ast.walk(node.slice)}
        elif isinstance(node, ast.arguments):
            allowed |= {id(c) for d in node.defaults + node.kw_defaults if d is not None
                        for c in ast.walk(d)}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            allowed |= {id(k) for k in node.value.keys if k is not None}
    return sorted((node.lineno, ast.get_source_segment(source, node) or "")
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in LAYOUT_NAMES
                  and id(node) not in allowed)


def test_the_layout_name_finder_allows_only_declarations():
    code = ('Layout = Literal["pad", "pack", "auto"]\n'
            'def f(layout: Layout = "pad"): ...\n'
            'OPTIONS = {"pad": (PAD,), "pack": (PACK, PAD)}\n'
            'if self.layout == "pack": ...\n'
            'ok = self.layout != "pad"\n'
            'x = seg.program("pack")\n'
            'y = table["auto"]\n'
            'match layout:\n    case "pad": ...\n'
            'z = layout in ("pad", "pack")\n')
    assert [line for line, _ in layout_names_read(code)] == [4, 5, 6, 7, 9, 10, 10]


def test_the_executor_never_branches_on_a_layouts_name():
    """Issue 50, item 5: the executor asks the layout objects (`_layouts.PAD`, ``PACK``) what
    differs -- which plans they run, their warm-up buckets, placing, packing across processes,
    their rows and grids, the program they export -- and reads the ``layout=`` option once,
    through its table; `polyexec.training` and the benchmark read no layout's internals (a
    segment's program by layout name, a plan's segments, the executor's layout state): they
    ask the `Bucketed` (``exported_program``, ``packing_of``)."""
    executor = PACKAGE / "_executor.py"
    found = [f"_executor.py:{line}: {code}"
             for line, code in layout_names_read(executor.read_text())]
    assert not found, "the executor asks layout objects, not names:\n" + "\n".join(found)
    root = PACKAGE.parent
    internals = {"segments", "_with_packed", "_layouts", "_by_cost", "_runs_in"}
    reads = []
    for path in sorted([*(PACKAGE / "training").rglob("*.py"), *(root / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr in internals:
                reads.append(f"{where}: .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "program"):
                reads.append(f"{where}: .program(...)")
            elif isinstance(node, ast.ImportFrom) and (
                    "_layouts" in (node.module or "") or any(a.name == "_layouts"
                                                             for a in node.names)):
                reads.append(f"{where}: imports _layouts")
    assert any(p.parts[-2] == "bench" for p in (root / "bench").rglob("*.py"))
    assert not reads, ("training and the benchmark ask the Bucketed, not a layout's "
                       "internals:\n" + "\n".join(reads))
