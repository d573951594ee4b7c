"""The project's code and docs cite only the project's own docs, and every citation resolves.

Code comments point maintainers at `docs/<file>.md#<section>`; a renamed heading or file must
not leave them pointing nowhere. Nothing may cite a file that is not in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
SOURCES = ("paperclip", "leases", "recovery", "checkpoints", "clients", "tests", "bench", "scripts")
CITATION = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
LINK = re.compile(r"\]\((?!https?:)([^)#\s]*)(?:#([\w-]+))?\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lowercase, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            found.add(anchor(m.group(1)))
    return found


def _code_files() -> list[Path]:
    files: list[Path] = []
    for top in SOURCES:
        files += [p for p in (ROOT / top).rglob("*.py") if "migrations" not in p.parts]
    return [*files, ROOT / "Makefile", ROOT / "pyproject.toml"]


def _doc_files() -> list[Path]:
    """README.md and every page under docs/, its subfolders (docs/reports/) included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_anchor_rule() -> None:
    assert anchor("Owner receipt CAS") == "owner-receipt-cas"
    assert anchor("`finalize` and `?wait=`") == "finalize-and-wait"
    assert anchor("Recovery-source checks, in order") == "recovery-source-checks-in-order"


def test_every_docs_citation_in_the_code_resolves() -> None:
    broken = []
    for path in _code_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name, section in CITATION.findall(line):
                target = ROOT / "docs" / name
                if not target.exists() or (section and section not in anchors(target)):
                    broken.append(f"{path.relative_to(ROOT)}:{number}: docs/{name}#{section}")
    assert broken == []


@pytest.mark.parametrize("doc", sorted(p.relative_to(ROOT) for p in _doc_files()))
def test_every_relative_link_in_the_docs_resolves(doc: Path) -> None:
    source = ROOT / doc
    broken = []
    for target, section in LINK.findall(source.read_text()):
        path = (source.parent / target).resolve() if target else source
        if not path.exists() or (section and path.suffix == ".md" and section not in anchors(path)):
            broken.append(f"{target}#{section}")
    assert broken == []


def test_nothing_cites_files_outside_the_repository() -> None:
    # Spelled in pieces, so that this file does not match its own search.
    names = ["CONTRA" + r"CT\.md", "UPSTR" + "EAM", "reference/up" + "stream", r"\.\./sha" + "red"]
    outside = re.compile("|".join(names))
    offenders = [
        str(path.relative_to(ROOT))
        for path in [*_code_files(), *_doc_files()]
        if outside.search(path.read_text())
    ]
    assert offenders == []
