"""The current-standing table is generated from artifacts, and README's copy is current."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_omni_edge_bench.harness import standing
from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"


def test_readme_table_is_regenerated_from_the_listed_runs():
    runs = standing.listed_runs()
    assert runs, "docs/edge/standing-runs.txt lists no run"
    assert standing.current_block(README) == standing.render(runs, standing.listed_arms()), \
        "run: edge-harness standing --update README.md"


def test_every_arm_of_a_listed_run_has_a_row_with_its_run_named():
    for run in standing.listed_runs():
        rows = standing.rows(run)
        grid = json.loads((run / "provenance.json").read_text())["effective_grid"]
        assert len(rows) == len(grid["arms"])
        assert all(f"`{run.name}`" in row for row in rows)


def test_a_run_that_is_not_ok_is_refused_by_name(tmp_path):
    run = standing.listed_runs()[0]
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary.update(status="crashed", reasons=["pass 1 arm serve crashed: boom"])
    (copy / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(standing.StandingError, match=f"{run.name}: status crashed: pass 1 arm serve crashed"):
        standing.rows(copy)


def test_update_rewrites_only_the_marked_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{standing.BEGIN}\nold\n{standing.END}\nafter\n")
    assert standing.update(doc, "| new |") is True
    assert doc.read_text() == f"before\n{standing.BEGIN}\n| new |\n{standing.END}\nafter\n"
    assert standing.update(doc, "| new |") is False
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(standing.StandingError, match="no .* block"):
        standing.update(tmp_path / "bare.md", "x")


def test_a_line_naming_arms_keeps_only_those_and_refuses_unknown_ones(tmp_path):
    run = standing.listed_runs()[0]
    listing = tmp_path / "runs.txt"
    first = json.loads((run / "provenance.json").read_text())["effective_grid"]["arms"][0]["name"]
    listing.write_text(f"# comment\n{run.relative_to(standing.PROJECT_ROOT)} {first}\n")
    arms = standing.listed_arms(listing)
    assert arms == {run: (first,)}
    assert len(standing.rows(run, arms[run])) == 1
    with pytest.raises(standing.StandingError, match="no arm nonesuch"):
        standing.rows(run, ("nonesuch",))


def test_the_box_is_named_by_isa_and_by_vendor_family_and_model_where_recorded():
    def box(**cpu):
        return standing._box({"provenance": {"cpu": {"physical_cores": 2, **cpu}}})

    assert box(kernel_flags={"avx512_vnni": True}, vendor="AuthenticAMD", family=26, model=2) == \
        "2-core AVX-512 VNNI (AMD family 26 model 2)"
    assert box(kernel_flags={"amx_tile": True, "avx512_vnni": True}, vendor="GenuineIntel", family=6,
               model=143) == "2-core AMX (Intel family 6 model 143)"
    assert box(kernel_flags={}, vendor="HygonGenuine", family=24, model=0) == "2-core AVX2 (HygonGenuine family 24 model 0)"
    # A run recorded before provenance kept the family: the ISA alone, as before.
    assert box(kernel_flags={"avx512_vnni": True}) == "2-core AVX-512 VNNI"
