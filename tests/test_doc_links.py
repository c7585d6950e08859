"""Every relative link in README, ROADMAP, the docs and the runs' notes points at a path that exists."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS = sorted([PROJECT_ROOT / "README.md", PROJECT_ROOT / "ROADMAP.md",
               *(PROJECT_ROOT / "docs").rglob("*.md"), *(PROJECT_ROOT / "results").glob("*/notes.md")])


def broken_links(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    return broken


def test_relative_links_resolve():
    assert len(DOCS) > 10
    broken = {str(doc.relative_to(PROJECT_ROOT)): links for doc in DOCS if (links := broken_links(doc))}
    assert not broken, f"links to paths that do not exist: {broken}"


def test_a_broken_link_is_found(tmp_path):
    doc = tmp_path / "doc.md"
    (tmp_path / "here.md").write_text("x")
    doc.write_text("[ok](here.md) [anchor](here.md#a) [web](https://example.com) [gone](results/none/report.md)\n"
                   "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(doc) == ["results/none/report.md"]
