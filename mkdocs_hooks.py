"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is README.md, so it is written once.

README links into docs/ as GitHub resolves them (`docs/design/layout.md`); on the site those paths are
relative to docs/. A docs/ page links README as `../README.md` (`../../README.md` one folder down),
which on the site is the home page.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        return re.sub(r"\]\(docs/", "](", README.read_text(encoding="utf-8"))
    home = "../" * page.file.src_uri.count("/") + "index.md"
    return re.sub(r"\]\((?:\.\./)+README\.md", "](" + home, markdown)
