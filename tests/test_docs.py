"""Every ```python block in docs/ runs, page by page, on four gloo processes."""
from __future__ import annotations

import glob
import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md")))


def snippets(path: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of a Markdown page."""
    text = open(path).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def _run_page(path: str) -> int:
    import sys
    import types
    # a real module (torch.compile looks up the module its code's globals name)
    page = types.ModuleType("functp_doc_page")
    sys.modules[page.__name__] = page
    env: dict = page.__dict__
    import torch
    dtype = torch.get_default_dtype()       # a page may change it: not for the next page
    try:
        _exec_snippets(path, env)
    finally:
        torch.set_default_dtype(dtype)
    return len(snippets(path))


def _exec_snippets(path: str, env: dict) -> None:
    import contextlib
    import io
    for line, code in snippets(path):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(code, f"{os.path.basename(path)}:{line}", "exec"), env)
            except Exception as e:
                raise AssertionError(f"{os.path.basename(path)}, snippet at line {line} "
                                     f"failed: {e!r}") from e


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)],
                         ids=lambda p: os.path.basename(p))
def test_doc_snippets_run(run, page):
    assert run(4, _run_page, page) == [len(snippets(page))] * 4


def test_api_reference_is_current():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_api", os.path.join(DOCS, "gen_api.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(os.path.join(DOCS, "api.md")) as f:
        assert f.read() == gen.render(), "docs/api.md is out of date: run python docs/gen_api.py"
