"""MkDocs hook: the docstrings are written with reStructuredText habits that mkdocstrings, rendering Markdown,
leaves standing. Cross-references as Sphinx roles (``:func:`name```, ``:class:`~pkg.Name```) keep the role before
the code span: drop it, and the module path where the name starts with ``~`` (Sphinx's "last component only"). A
paragraph ending in ``::`` that introduces a literal block ends in one colon."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):<code>(~(?:\w+\.)*)?([^<]*)</code>")
LITERAL_MARKER = re.compile(r"::</p>")


def on_page_content(html: str, **_: object) -> str:
    html = ROLE.sub(lambda m: f"<code>{m.group(2)}</code>", html)
    return LITERAL_MARKER.sub(":</p>", html)
