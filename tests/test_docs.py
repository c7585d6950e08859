"""The documents keep their shape: README short with the two fresh-machine commands, ROADMAP one
short line per item with rejected ideas citing artifacts that exist, and every relative link
in README, ROADMAP, the docs and the runs' notes pointing at a path that exists."""

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


README = PROJECT_ROOT / "README.md"
ROADMAP = PROJECT_ROOT / "ROADMAP.md"


def test_readme_is_short_and_keeps_the_two_fresh_machine_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "```bash\nscripts/setup.sh && .venv/bin/vllm-omni-edge demo\n```" in text
    assert "```bash\nscripts/test.sh\n```" in text
    assert "exec scripts/test.sh" in (PROJECT_ROOT / ".ci" / "run").read_text()


def test_roadmap_lines_are_short_and_each_rejected_idea_cites_an_artifact_that_exists():
    lines = ROADMAP.read_text().splitlines()
    assert all(len(line) <= 600 for line in lines), [line[:80] for line in lines if len(line) > 600]
    rejected = lines[lines.index("## Tried and rejected"):]
    rows = [line for line in rejected if line.startswith("| ") and not line.startswith("| idea")]
    assert len(rows) > 5
    for row in rows:
        artifact = row.rstrip(" |").rsplit("|", 1)[1]
        cited = re.findall(r"results/([^`/ ]+)", artifact)
        assert cited or "no artifact" in artifact, f"{row[:60]}: no artifact named"
        for run in cited:
            assert (PROJECT_ROOT / "results" / run).is_dir(), f"{row[:60]}: results/{run} does not exist"
