"""A griffe extension for the API reference: docstring examples (``>>>`` lines and the output
under them) become fenced ``pycon`` blocks, so Markdown neither links nor reflows them.

polyexec's docstrings are prose with doctest examples (run by tests/test_doctests.py); this is
the one place their rendering is adapted. Loaded by mkdocs.yml (mkdocstrings' ``extensions``).
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wrap each run of doctest lines (a ``>>>`` line, its ``...`` continuations and output up
    to a blank line) in a ``pycon`` fence; leave prose and existing fences alone.

    >>> print(fence_doctests("Prose.\\n\\n>>> 1 + 1\\n2\\n\\nMore."))
    Prose.
    <BLANKLINE>
    ```pycon
    >>> 1 + 1
    2
    ```
    <BLANKLINE>
    More.
    """
    out: list[str] = []
    lines = text.splitlines()
    i, in_fence = 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence every object's docstring examples as it is loaded."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
