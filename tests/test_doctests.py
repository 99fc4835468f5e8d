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


# The README's and the docs' code blocks run in tests/test_docs.py.
