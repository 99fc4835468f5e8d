"""The documentation runs: every ```python block of README.md and of every docs/ page, the site
builds with ``mkdocs build --strict``, and the generated pages are what their scripts make.

Convention for pages (docs/index.md says it to writers too):

- The ```python blocks of one page run in order in one fresh namespace, as a reader pasting them
  into one session would (a page's later blocks may use its earlier names), in a temporary
  working directory.
- A ```python block followed directly (blank lines only in between) by a ```text block must
  print that text. Compared as doctest compares output: ``...`` matches anything
  (ELLIPSIS) and runs of whitespace are equal (NORMALIZE_WHITESPACE). A block without a
  ```text block after it must run; what it prints is not compared.
- Commands that need several processes, a shell or the benchmark CLI are ```bash blocks and are
  not run here (tests/test_multiprocess.py and tests/test_bench.py run those paths).
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, str, str | None, int]]:
    """(language, code, expected output or None, line) of each fenced block that is not
    itself the output of the block before it."""
    found = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    out = []
    i = 0
    while i < len(found):
        lang, code, start, end = found[i]
        expected = None
        if (lang == "python" and i + 1 < len(found) and found[i + 1][0] == "text"
                and not text[end:found[i + 1][2]].strip()):
            expected = found[i + 1][1]
            i += 1
        out.append((lang, code, expected, text.count("\n", 0, start) + 2))
        i += 1
    return out


def check_output(got: str, want: str) -> bool:
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    return doctest.OutputChecker().check_output(want, got, flags)


def run_page(page: str) -> list[str]:
    """Run a page's python blocks; return what each printed. Fails naming page and line."""
    text = (ROOT / page).read_text(encoding="utf-8")
    namespace: dict = {"__name__": "__docs__"}
    printed = []
    for lang, code, expected, line in blocks(text):
        if lang != "python":
            continue
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)
        got = buffer.getvalue()
        printed.append(got)
        if expected is not None:
            assert check_output(got, expected), (
                f"{page}:{line}: the block printed\n{got}\nbut the page shows\n{expected}")
    return printed


def test_pages_are_found():
    assert {"README.md", "docs/index.md", "docs/getting-started.md",
            "docs/concepts/exact.md", "docs/troubleshooting.md"} <= set(PAGES)


def test_block_parser_pairs_code_with_its_output():
    page = ("```python\nprint(1)\n```\n\n```text\n1\n```\n\n```bash\nls\n```\n"
            "```python\nx = 2\n```\ntext between\n```text\nnot output\n```\n")
    assert [(b[0], b[2]) for b in blocks(page)] == [
        ("python", "1\n"), ("bash", None), ("python", None), ("text", None)]
    assert check_output("[49.5  3.5  0. ]\n", "[49.5 3.5 0. ]\n")
    assert check_output("loss 0.6931\n", "loss ...\n")
    assert not check_output("True\n", "False\n")


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_and_print_what_the_page_shows(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    run_page(page)
    assert time.perf_counter() - start < 120, f"{page}: keep the docs' examples small"


def test_readme_example_prints_each_rows_mean(tmp_path, monkeypatch):
    """The README's one example: each row's mean over its own length, no mask in the code,
    one trace; the explicit form of what its ```text block shows."""
    monkeypatch.chdir(tmp_path)
    out = run_page("README.md")
    lines = "".join(out).splitlines()
    assert lines[0] == "[9.5 3.5 0. ]", lines
    assert "False 1" in lines, lines


def test_readme_is_one_screen_and_keeps_its_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    test_command = ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
                    ".venv/bin/python -m pytest -q -n 2")
    assert test_command in readme and ci == test_command
    assert ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
            ".venv/bin/python -m examples.rnn.train") in readme


def test_no_internal_milestone_names():
    """Figures are dated by commit on the benchmarks page, never by internal milestones."""
    pattern = re.compile(r"\bstops? [0-9]{1,3}\b")
    found = []
    for folder in ("docs", "polyexec", "buckets", "bench", "examples", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".json", ".yml"} and path.is_file():
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if pattern.search(line) and "pattern = re.compile" not in line:
                        found.append(f"{path.relative_to(ROOT)}:{n}")
    for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if pattern.search(line):
            found.append(f"README.md:{n}")
    assert not found, found


def test_benchmarks_page_is_generated_from_the_results_file():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_benchmarks
    finally:
        sys.path.remove(str(DOCS))
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert page == gen_benchmarks.render(gen_benchmarks.load()), (
        "docs/benchmarks.md differs from its generator: run python docs/gen_benchmarks.py")


def test_layouts_figure_script_draws_the_committed_figure(tmp_path):
    out = tmp_path / "layouts.png"
    subprocess.run([sys.executable, str(DOCS / "figures" / "layouts.py"), str(out)], check=True,
                   env={**os.environ, "MPLBACKEND": "Agg"}, timeout=120)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (DOCS / "figures" / "layouts.png").is_file()
    assert "figures/layouts.png" in (DOCS / "concepts" / "layouts.md").read_text()


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is in the test extra")
    pytest.importorskip("material", reason="mkdocs-material is in the test extra")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "polyexec" / "index.html").is_file()
