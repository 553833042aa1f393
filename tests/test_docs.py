"""The documentation's examples run: every `>>>` block in docs/*.md and in jaxkv's docstrings.

A failing example prints doctest's report (expected and got) in the test's captured output.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pathlib
import pkgutil

import pytest

import jaxkv

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Pages whose examples need an optional package (a test extra): without it they skip, naming
# it, except under CI (`CI` set), which installs the extras and fails instead.
NEEDS = {"stores.md": ("redis", "redis-py (`pip install 'jaxkv[redis]'`)")}


def _has_examples(name: str) -> bool:
    module = importlib.import_module(name)
    return any(t.examples for t in doctest.DocTestFinder().find(module))


# Every module of the package whose docstrings hold examples (the CLI entry point excluded).
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(jaxkv.__path__, "jaxkv.")
    if m.name != "jaxkv.__main__" and _has_examples(m.name)
)


def test_docs_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "pools.md", "allocators.md", "connector.md", "stores.md"} <= names
    assert {"models.md", "cli.md"} <= names
    assert {"jaxkv.pools", "jaxkv.allocators", "jaxkv.connector._connector"} <= set(MODULES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples(page, tmp_path, monkeypatch):
    module, what = NEEDS.get(page.name, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{page.name} needs {what}, which CI installs")
        pytest.skip(f"{page.name} needs {what}")
    monkeypatch.chdir(tmp_path)  # anything an example writes lands in a temporary folder
    result = doctest.testfile(str(page), module_relative=False, optionflags=FLAGS)
    assert result.attempted > 0, f"{page.name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
