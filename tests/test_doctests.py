"""The runnable examples in polyexec's docstrings, so the README's test command covers them."""

import doctest
import importlib
import pkgutil

import pytest

import polyexec

MODULES = sorted(m.name for m in pkgutil.walk_packages(polyexec.__path__, "polyexec."))


def test_every_module_is_found():
    assert {"polyexec._executor", "polyexec._plan", "polyexec.testing"} <= set(MODULES)


@pytest.mark.parametrize("name", ["polyexec", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_public_names_carry_runnable_examples():
    """A docstring example is the contract for the main entry points."""
    for obj in (polyexec.bucketed, polyexec.trace, polyexec.Plan, polyexec.LengthVar,
                polyexec.Spec, polyexec.valid_length, polyexec.forbid_compiles):
        examples = doctest.DocTestParser().get_examples(obj.__doc__ or "")
        assert examples, f"{obj.__name__} has no runnable example in its docstring"


def test_readme_usage_blocks_run_as_pasted(capsys):
    """The README's first three Python blocks (ragged mean; packed rows; unmasked code made
    exact), pasted in order into one session: they run and print what the README says."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    session: dict = {}
    for block in blocks[:3]:
        exec(compile(block, "README.md", "exec"), session)
    out = capsys.readouterr().out.splitlines()
    # Each row's mean over its own length (lengths 100, 8, 1 of 0..99), no mask in the code.
    assert out[0] == "[49.5  3.5  0. ]" and out[1] == "False 1" and out[-1] == "True", out
    # Packed: 114 real cells of the 5 sequences in 2 rows of 64, the same value and gradient.
    assert "True 0.890625" in out, out
