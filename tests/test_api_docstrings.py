"""The API page's docstrings parse as reStructuredText, as the book's build reads them.

``book/api.md`` renders the docstrings of the modules it lists through Sphinx's autodoc and napoleon (Google style),
and the build fails on any warning; a docstring that breaks the markup (an inline literal split across lines inside
a ``Returns:`` section, 2026-12-07) was found only at the end of a 50-minute CI run.  Here each docstring goes through
napoleon and docutils in seconds.  Docutils does not know Sphinx's roles and directives (``:func:``, ``.. math::``),
and Sphinx turns ``Args:`` fields such as ``lambda_`` into parameter names before references are resolved, so those
messages are left out; every other warning or error fails.
"""

from __future__ import annotations

import importlib
import inspect
import io
import re
from pathlib import Path

import pytest

docutils_core = pytest.importorskip("docutils.core", reason="docutils comes with the book's tools (make setup)")
napoleon = pytest.importorskip("sphinx.ext.napoleon", reason="Sphinx is a book tool (make setup)")
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

API_PAGE = Path(__file__).resolve().parents[1] / "book" / "api.md"
# messages that only Sphinx's own roles, directives and field handling resolve
SPHINX_ONLY = re.compile(r"Unknown interpreted text role|Unknown directive type|No (role|directive) entry|"
                         r"Trying .* as canonical|Unknown target name")
PROBLEM = re.compile(r"\((WARNING|ERROR|SEVERE)/\d\)")


def documented_modules() -> list[str]:
    return re.findall(r"^\.\. automodule:: (\S+)", API_PAGE.read_text(), re.M)


def docstrings(module) -> list[tuple[str, str]]:
    """(where, docstring) of the module, its public functions and classes, and their public methods and properties."""
    found = [(module.__name__, inspect.getdoc(module))]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            found.append((f"{module.__name__}.{name}", inspect.getdoc(obj)))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                member = getattr(member, "__func__", member)
                if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    found.append((f"{module.__name__}.{name}.{attr}", inspect.getdoc(member)))
    return [(where, doc) for where, doc in found if doc]


def markup_problems(docstring: str) -> list[str]:
    """Docutils' warnings and errors for ``docstring`` as napoleon converts it, Sphinx-only ones left out."""
    rst = str(GoogleDocstring(docstring, napoleon.Config(napoleon_numpy_docstring=False)))
    messages = io.StringIO()
    docutils_core.publish_doctree(rst, settings_overrides={"warning_stream": messages, "report_level": 2,
                                                           "halt_level": 5})
    return [line for line in messages.getvalue().splitlines() if PROBLEM.search(line) and not SPHINX_ONLY.search(line)]


def test_the_check_sees_a_broken_inline_literal():
    broken = 'Summary.\n\nReturns:\n    ``{"a": {"b",\n    "c"}}`` (the mapping).\n'
    assert any("Inline literal" in m for m in markup_problems(broken))
    assert markup_problems('Summary.\n\nReturns:\n    ``{"a": "b"}``, the mapping (:func:`f`).\n') == []


@pytest.mark.parametrize("name", documented_modules())
def test_every_docstring_on_the_api_page_parses(name):
    problems = {where: found for where, doc in docstrings(importlib.import_module(name))
                if (found := markup_problems(doc))}
    assert not problems, problems


def test_the_api_page_lists_modules():
    assert len(documented_modules()) > 40
