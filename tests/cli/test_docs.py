"""The docs hold together: every relative link in the README and docs/ points at a file that
exists and, with an anchor, at a heading of that file (GitHub's heading ids)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_ids(page: Path) -> set[str]:
    """GitHub's ids: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    ids: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n, base = 0, slug
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here (no network)
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
