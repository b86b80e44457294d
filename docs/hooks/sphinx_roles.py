"""MkDocs hook: the docstrings write cross-references as Sphinx roles (``:func:`name```, ``:class:`~pkg.Name```);
mkdocstrings renders them as Markdown, where the role is left standing before the code span. Drop the role, and the
module path where the name starts with ``~`` (Sphinx's "last component only")."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):<code>(~(?:\w+\.)*)?([^<]*)</code>")


def on_page_content(html: str, **_: object) -> str:
    return ROLE.sub(lambda m: f"<code>{m.group(2)}</code>", html)
