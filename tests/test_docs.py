"""Every ```python block in docs/ and in the README runs, page by page, and prints what
the page shows; the README's commands name files that exist.

A plain ```python block runs in this process (its programs use ``functp.simulate``);
the lines after a ``# prints:`` comment in it are compared with what it printed, and
the lines after ``# raises:`` with the exception its last statement raises, as a
traceback's last line shows it (``ShardingError: ...``). ``...`` in a shown line
stands for any text on that line (an estimate's host numbers, which vary with what
ran before in the process). A ```python torchrun block is per-rank code: the page's
torchrun blocks run, in order, on four gloo processes, and each rank's output is
compared with its ``# prints:`` / ``# raises:``. troubleshooting.md's error blocks are
the table of errors, tests/_error_table.py.

Each block is checked one way, and counted so: *compared* (its ``# prints:`` or
``# raises:``), or *runs only*, which only a setup block may be (imports and
``torch.set_default_dtype``/``manual_seed``). A block that prints what the page does
not show fails, and so does one that shows nothing (an ``assert`` alone is not shown:
print what it checks). Every Python block of a page is run: a fence other than
```python and ```python torchrun (```python-norun, ```py) fails.
"""
from __future__ import annotations

import ast
import contextlib
import glob
import inspect
import io
import os
import re
import sys
import textwrap
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [README]
# all the Markdown: the top folder's and each folder's below it
MARKDOWN = sorted(glob.glob(os.path.join(ROOT, "*.md"))
                  + glob.glob(os.path.join(ROOT, "*", "*.md")))


def snippets(path: str, torchrun: bool | None = None) -> list[tuple[int, str]]:
    """(line number, code) of the ```python blocks of a Markdown page: all of them, or
    only the torchrun ones (``True``) or only the others (``False``)."""
    text = open(path).read()
    return [(text[:m.start()].count("\n") + 2, m.group(2))
            for m in re.finditer(r"^```python( torchrun)?\n(.*?)^```", text, re.S | re.M)
            if torchrun is None or bool(m.group(1)) == torchrun]


def _shown(code: str, marker: str) -> str | None:
    """The comment lines after ``marker`` (up to the next marker), comment markers
    removed; None without one."""
    lines = code.split("\n")
    if marker not in lines:
        return None
    out = []
    for ln in lines[lines.index(marker) + 1:]:
        if ln in _MARKERS:
            break
        if ln.startswith("#"):
            out.append(ln[2:] + "\n" if ln.startswith("# ") else "\n")
    return "".join(out)


_MARKERS = ("# prints:", "# raises:")


def expected_output(code: str) -> str | None:
    """The text after ``# prints:``, comment markers removed; None without one."""
    return _shown(code, "# prints:")


def expected_error(code: str) -> str | None:
    """The exception shown after ``# raises:`` (``Type: message``); None without one."""
    return _shown(code, "# raises:")


def _page_module() -> dict:
    # a real module (torch.compile looks up the module its code's globals name)
    page = types.ModuleType("functp_doc_page")
    sys.modules[page.__name__] = page
    return page.__dict__


def _exec(path: str, line: int, code: str, env: dict) -> tuple[str, str | None]:
    """What a block printed, and what it raised (``Type: message``) where it shows
    ``# raises:``; any other exception fails."""
    out, raised = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, f"{os.path.basename(path)}:{line}", "exec"), env)
        except Exception as e:
            if expected_error(code) is None:
                raise AssertionError(f"{os.path.basename(path)}, snippet at line {line} "
                                     f"failed: {e!r}") from e
            raised = f"{type(e).__name__}: {e}\n"
    return out.getvalue(), raised


_SETUP_CALLS = {"torch.set_default_dtype", "torch.manual_seed"}


def _is_setup(code: str) -> bool:
    """Only imports and the global settings later blocks rely on."""
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) in _SETUP_CALLS):
            continue
        return False
    return True


def shows(printed: str, shown: str) -> bool:
    """Whether ``printed`` is what the page shows: the same lines, where ``...`` in a
    shown line stands for any text on that line."""
    if "..." not in shown:
        return printed == shown
    lines, want = printed.split("\n"), shown.split("\n")
    return len(lines) == len(want) and all(
        re.fullmatch(".*".join(map(re.escape, w.split("..."))), ln)
        for ln, w in zip(lines, want))


def checked(page: str, line: int, code: str, printed: str, raised: str | None = None) -> str:
    """How a block that printed ``printed`` (and raised ``raised``) is checked:
    ``compared`` or ``runs only`` (a setup block); raises when it is not checked."""
    where = f"{os.path.basename(page)}, snippet at line {line}"
    want, error = expected_output(code), expected_error(code)
    if error is not None:
        assert raised == error, (f"{where} raised:\n{raised or '(nothing)'}\nbut the page "
                                 f"shows:\n{error}")
        assert shows(printed, want or ""), f"{where} printed:\n{printed}but the page shows:\n{want}"
        return "compared"
    if want is not None:
        assert shows(printed, want), f"{where} printed:\n{printed}but the page shows:\n{want}"
        return "compared"
    assert printed == "", f"{where} printed:\n{printed}which the page does not show (# prints:)"
    assert _is_setup(code), (f"{where} shows nothing: print what it checks and show the "
                             f"output (# prints:); an assert alone is not shown")
    return "runs only"


def _run_torchrun_blocks(path: str) -> list[tuple[int, str, str | None]]:
    """(line, what this rank printed, what it raised) of each torchrun block of a
    page, in order."""
    import torch
    env = _page_module()
    dtype = torch.get_default_dtype()       # a page may change it: not for the next page
    try:
        return [(line, *_exec(path, line, code, env))
                for line, code in snippets(path, torchrun=True)]
    finally:
        torch.set_default_dtype(dtype)


def _before(code: str, marker: str) -> str:
    """A block's code: its lines before ``marker``."""
    lines = code.split("\n")
    return "".join(ln + "\n" for ln in lines[:lines.index(marker)])


def test_troubleshooting_shows_the_table_of_errors():
    # each block that shows an error is an entry of tests/_error_table.py, in the
    # table's order (its code, then its exception and message), and every entry is
    # shown; tests/test_errors.py runs the entries, test_doc_torchrun_... the blocks
    import _error_table as table
    page = os.path.join(DOCS, "troubleshooting.md")
    blocks = snippets(page, torchrun=True)
    assert not excerpt_gaps(table.SETUP, blocks[0][1]), "the page's first block is the setup"
    shown = [(line, _before(code, "# raises:"), expected_error(code))
             for line, code in blocks if expected_error(code) is not None]
    for k, e in enumerate(table.ERRORS):
        assert k < len(shown), f"troubleshooting.md does not show the entry\n{e.code}"
        line, code, error = shown[k]
        assert (code, error) == (e.code, e.shown()), (
            f"troubleshooting.md, block at line {line}:\n{code}# raises:\n{error}\nwhere "
            f"the table's entry {k} is\n{e.code}# raises:\n{e.shown()}")
    assert len(shown) == len(table.ERRORS), f"not in the table: {shown[len(table.ERRORS):]}"


def _tally(kinds: list[str]) -> dict[str, int]:
    return {k: kinds.count(k) for k in ("compared", "runs only")}


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p, torchrun=False)],
                         ids=lambda p: os.path.basename(p))
def test_doc_snippets_print_what_the_page_shows(page, record_property):
    import torch
    env = _page_module()
    dtype = torch.get_default_dtype()
    try:
        kinds = [checked(page, line, code, *_exec(page, line, code, env))
                 for line, code in snippets(page, torchrun=False)]
    finally:
        torch.set_default_dtype(dtype)
    record_property("blocks", _tally(kinds))


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p, torchrun=True)],
                         ids=lambda p: os.path.basename(p))
def test_doc_torchrun_snippets_print_what_the_page_shows(run, page, record_property):
    blocks = snippets(page, torchrun=True)
    for rank, outputs in enumerate(run(4, _run_torchrun_blocks, page, gloo=True)):
        assert [out[0] for out in outputs] == [line for line, _ in blocks], rank
        kinds = [checked(page, line, code, printed, raised)
                 for (line, code), (_, printed, raised) in zip(blocks, outputs)]
    record_property("blocks", _tally(kinds))


def test_a_block_is_checked_one_way():
    page = "page.md"
    assert checked(page, 1, "print(1)\n# prints:\n# 1", "1\n") == "compared"
    assert checked(page, 1, "import torch\ntorch.manual_seed(0)", "") == "runs only"
    for code in ("x = torch.ones(2)", "x = 1\nassert x == 1"):     # an assert is not shown
        with pytest.raises(AssertionError, match="shows nothing"):
            checked(page, 1, code, "")
    with pytest.raises(AssertionError, match="does not show"):
        checked(page, 1, "print(1)\nassert True", "1\n")
    with pytest.raises(AssertionError, match="but the page shows"):
        checked(page, 1, "print(2)\n# prints:\n# 1", "2\n")
    error_block = "f()\n# raises:\n# ShardingError: no"
    assert checked(page, 1, error_block, "", "ShardingError: no\n") == "compared"
    for raised in (None, "ShardingError: yes\n", "ValueError: no\n"):
        with pytest.raises(AssertionError, match="but the page shows"):
            checked(page, 1, error_block, "", raised)


def test_dots_in_a_shown_line_stand_for_any_text_on_that_line():
    assert shows("host 2.89 ms (1458 calls): host-bound\n", "host ... ms (... calls): host-bound\n")
    assert shows("f(..., 'dp')\n", "f(..., 'dp')\n")
    assert not shows("host 2.89 s\n", "host ... ms\n")
    assert not shows("host 2.89 ms\nmore\n", "host ...\n")       # not across lines
    assert checked("page.md", 1, "print(2)\n# prints:\n# ...", "2\n") == "compared"


def test_a_block_that_shows_an_error_must_raise_it():
    env = {}
    code = "print(1)\nraise ValueError('two\\nlines')\n# prints:\n# 1\n# raises:\n# ValueError: two\n# lines"
    assert _exec("page.md", 1, code, env) == ("1\n", "ValueError: two\nlines\n")
    assert expected_output(code) == "1\n" and expected_error(code) == "ValueError: two\nlines\n"
    with pytest.raises(AssertionError, match="failed"):     # (one the page does not show)
        _exec("page.md", 1, "raise ValueError('x')", env)


def test_a_prints_block_is_read_as_shown():
    assert expected_output("x = 1\nprint(x)\n# prints:\n# 1\n#\n# [rank 0] a") == "1\n\n[rank 0] a\n"
    assert expected_output("print(1)") is None


def unrun_blocks(text: str) -> list[tuple[int, str]]:
    """(line, fence) of each Python block of a page that is not run: a fence that
    names Python (```python-norun, ```py, ```python3) other than ```python and
    ```python torchrun."""
    return [(text[:m.start()].count("\n") + 1, m.group(0))
            for m in re.finditer(r"^```[ \t]*py[^\n]*", text, re.M)
            if m.group(0) not in ("```python", "```python torchrun")]


def test_every_python_block_runs():
    # no block is shown without being run: the code a reader sees is code that ran
    # and printed what the page shows (an excerpt of an example, for instance, runs
    # in miniature instead)
    found = [f"{os.path.relpath(page, ROOT)}:{line}: {fence}" for page in MARKDOWN
             for line, fence in unrun_blocks(open(page).read())]
    assert not found, "blocks that are not run: " + "; ".join(found)


def test_a_block_that_is_not_run_is_found():
    text = "a\n```python\nx\n```\n```python-norun\ny\n```\n```py\n```\n```python torchrun\n```\n"
    assert unrun_blocks(text) == [(5, "```python-norun"), (8, "```py")]


def _code_lines(code: str) -> list[str]:
    """The code of each line, comments and blank lines left out, white space folded."""
    out = [" ".join(ln.split("#")[0].split()) for ln in code.splitlines()]
    return [ln for ln in out if ln and ln != "..."]


def excerpt_gaps(code: str, source: str) -> list[str]:
    """The lines of ``code`` that do not stand in ``source`` in the same order."""
    have, i, gaps = _code_lines(source), 0, []
    for ln in _code_lines(code):
        j = next((j for j in range(i, len(have)) if ln in have[j]), None)
        if j is None:
            gaps.append(ln)
        else:
            i = j + 1
    return gaps


def test_an_excerpt_must_stand_in_its_source_in_order():
    source = "a = 1\nb = a + 1   # why\nc = b * 2\n"
    assert excerpt_gaps("a = 1\n...\nc = b * 2  # shown", source) == []
    assert excerpt_gaps("c = b * 2\na = 1", source) == ["a = 1"]
    assert excerpt_gaps("d = 4", source) == ["d = 4"]


def docstring_examples(doc: str) -> list[str]:
    """The literal blocks (after a line ending in ``::``) of a docstring that show
    what they print (``# prints:``), dedented."""
    lines, out, i = doc.split("\n"), [], 0
    while i < len(lines):
        i += 1
        if not lines[i - 1].rstrip().endswith("::"):
            continue
        block = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            block.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(block)).strip("\n")
        if "# prints:" in code.split("\n"):
            out.append(code + "\n")
    return out


def _public_docs() -> dict[str, str]:
    import functp
    return {n: inspect.getdoc(getattr(functp, n)) or "" for n in functp.__all__}


@pytest.mark.parametrize("name", [n for n, d in _public_docs().items()
                                  if docstring_examples(d) or ">>> " in d])
def test_docstring_examples_print_what_they_show(name):
    # an example that shows its output (# prints:, or a doctest's >>>) runs as shown,
    # with torch, functp and P imported (a mesh it needs it makes under simulate)
    import doctest
    import functp
    import torch
    obj, doc = getattr(functp, name), _public_docs()[name]
    for code in docstring_examples(doc):
        env = {"torch": torch, "functp": functp, "P": functp.P}
        printed, _ = _exec(f"functp.{name}", 0, code, env)
        want = expected_output(code)
        assert printed == want, f"functp.{name}'s example printed:\n{printed}but shows:\n{want}"
    if ">>> " in doc:
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in doctest.DocTestFinder(recurse=False).find(obj, f"functp.{name}",
                                                              globs={"P": functp.P}):
            assert runner.run(test, out=lambda _: None).failed == 0, f"functp.{name}'s doctest"


def test_a_docstring_example_is_found_with_its_output():
    doc = "Sums.\n\nExample::\n\n    print(1 + 1)\n    # prints:\n    # 2\n\nMore text."
    assert docstring_examples(doc) == ["print(1 + 1)\n# prints:\n# 2\n"]
    assert docstring_examples("Example::\n\n    x = 1\n") == []


def test_api_reference_is_current():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_api", os.path.join(DOCS, "gen_api.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(os.path.join(DOCS, "api.md")) as f:
        assert f.read() == gen.render(), "docs/api.md is out of date: run python docs/gen_api.py"


def _commands(path: str) -> list[str]:
    text = open(path).read()
    return [m.group(1) for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M)]


def test_readme_commands_run_files_that_exist():
    # the first command trains examples/train_lm.py (tests/test_examples.py runs it),
    # the second runs the tests; every script a command names is in the repository
    commands = _commands(README)
    assert commands[0].strip().endswith("python examples/train_lm.py"), commands[0]
    assert any(c.strip().endswith("python3 -m pytest -q -n 2 tests") for c in commands), commands
    # and it is the command CI runs (.ci/run's suite(), on its test paths)
    assert '-m pytest -q -n 2 "$@"' in open(os.path.join(ROOT, ".ci", "run")).read()
    scripts = [s for c in commands for s in re.findall(r"python3? (\S+\.py)", c)]
    assert scripts, commands
    for script in scripts:
        assert os.path.isfile(os.path.join(ROOT, script)), script
