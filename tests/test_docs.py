"""The docs: the MkDocs site builds with --strict, and README.md stays short with links that resolve.

A broken link, a missing anchor, a page left out of the nav or a docstring the API reference cannot
render fails here rather than on the published site.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 350
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of a markdown link or image: ](target)


@pytest.mark.timeout(180)
def test_mkdocs_build_strict(tmp_path):
    """mkdocs.yml's validation makes broken links, missing anchors and pages missing from the nav warnings;
    --strict turns every warning into a failure. The build reads the source statically: no torch, no ray."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a warning
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    assert (tmp_path / "index.html").is_file()


@pytest.mark.timeout(10)
def test_readme_is_short():
    """README keeps what a newcomer needs first; the rest lives in docs/ pages."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


@pytest.mark.timeout(10)
def test_readme_relative_links_exist():
    """README's relative links must resolve on GitHub, where mkdocs' checks do not reach."""
    targets = [t for t in LINK.findall(README.read_text(encoding="utf-8"))
               if not t.startswith(("http://", "https://", "mailto:", "#"))]
    assert targets, "README.md links no docs page"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"
