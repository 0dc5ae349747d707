"""The project's own files: the licence pyproject declares, a docs index that lists every page, and
relative links (and their #anchors) that land somewhere."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_licence_is_the_apache_2_text_pyproject_declares():
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}
    for words in ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, REPRODUCTION",
                  "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert words in licence


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {target for target in LINK.findall(index) if "/" not in target}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - listed == set(), "pages missing from docs/README.md"


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
