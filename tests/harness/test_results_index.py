"""docs/edge/results.md is generated: the standing table and one line per results directory."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_omni_edge_bench.harness import results_index, standing
from vllm_omni_edge_bench.harness.cli import main
from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT


def test_results_page_is_regenerated_from_the_artifacts():
    assert results_index.PAGE.read_text() == results_index.render(), \
        "run: edge-harness results-index --write docs/edge/results.md"


def test_the_page_carries_the_standing_table_and_every_run_once():
    page = results_index.render()
    assert standing.render(standing.listed_runs(), standing.listed_arms()) in page
    index = page[page.index("## Runs"):]
    for run in results_index.runs():
        assert index.count(f"| `{run.name}` |") == 1, run.name
        assert f"../../results/{run.name}/" in index


def test_each_line_names_what_ran_the_box_and_links_the_report(tmp_path):
    results = tmp_path / "results"
    source = PROJECT_ROOT / "results" / "2026-12-03-user-commands-default"
    run = results / source.name
    run.mkdir(parents=True)
    for name in ("grid.yaml", "summary.json", "provenance.json", "report.md"):
        shutil.copy(source / name, run / name)
    line = results_index.index_row(source, results_index.PAGE.parent)
    assert line.startswith(f"| 2026-12-03 | `{source.name}` | SmolLM2-135M cpu_int4 as a user starts it")
    assert "| 2-core Intel Xeon Processor, AMX |" in line
    assert f"[report.md](../../results/{source.name}/report.md)" in line
    summary = json.loads((run / "summary.json").read_text())
    summary["status"] = "invalid"
    (run / "summary.json").write_text(json.dumps(summary))
    assert "(status: invalid)" in results_index.describe(run)[0]
    assert results_index.describe(run)[1] == "2-core Intel Xeon Processor, AMX"


def test_runs_without_a_report_link_their_own_artifact_and_unknown_ones_are_refused(tmp_path):
    kernel = PROJECT_ROOT / "results" / "2026-12-01-kernel-decode-qwen-t1"
    line = results_index.index_row(kernel, results_index.PAGE.parent)
    assert "kernel benchmark for routing (x86-avx2): qwen2.5-coder-1.5b, decode, 1 thread(s), a subset of paths" in line
    assert "| 2-core AMD EPYC, AVX2 |" in line
    assert f"[kernel_paths.json](../../results/{kernel.name}/kernel_paths.json)" in line
    (tmp_path / "mystery").mkdir()
    with pytest.raises(FileNotFoundError, match="no artifact the index knows"):
        results_index.describe(tmp_path / "mystery")


def test_a_spoken_question_run_is_described_with_its_box(tmp_path):
    source = PROJECT_ROOT / "results" / "2026-12-05-spoken-question-int4-epyc"
    line = results_index.index_row(source, results_index.PAGE.parent)
    assert "Whisper cpu_int4 -> default, 3 passes" in line and "| named in notes.md |" in line
    assert f"[spoken_question.json](../../results/{source.name}/spoken_question.json)" in line
    run = tmp_path / "run"
    run.mkdir()
    record = json.loads((source / "spoken_question.json").read_text())
    record["provenance"] = {"cpu": {"physical_cores": 2, "model_name": "AMD EPYC",
                                    "kernel_flags": {"avx512_vnni": True}}}
    (run / "spoken_question.json").write_text(json.dumps(record))
    assert results_index.describe(run)[1] == "2-core AMD EPYC, AVX-512 VNNI"


def test_box_names_the_isa_that_routing_goes_by():
    flags = {"avx2": True, "avx512f": True, "avx512_vnni": True}
    cpu = {"physical_cores": 2, "model_name": "AMD EPYC", "kernel_flags": flags}
    assert results_index.box(cpu) == "2-core AMD EPYC, AVX-512 VNNI"
    with_avx_vnni = {**cpu, "kernel_flags": {**flags, "avx_vnni": True}}
    assert results_index.box(with_avx_vnni) == "2-core AMD EPYC, AVX-512 VNNI + AVX-VNNI"
    assert results_index.box({**cpu, "kernel_flags": {"avx2": True}}) == "2-core AMD EPYC, AVX2"
    assert results_index.box(None) == "not recorded"


def test_cli_check_fails_on_a_stale_page(tmp_path, capsys):
    assert main(["results-index", "--check", str(results_index.PAGE)]) == 0
    stale = tmp_path / "results.md"
    stale.write_text("# Results\n")
    assert main(["results-index", "--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().out


def test_a_decode_decomposition_is_described_with_its_command_and_box():
    source = PROJECT_ROOT / "results" / "2026-12-05-decode-decompose-smollm2-epyc"
    line = results_index.index_row(source, results_index.PAGE.parent)
    assert ("decode step split by stubbing ops (an observation): SmolLM2-135M-Instruct-cpu_int4, "
            "`LLM(max_model_len=512)`, 5 rounds") in line
    assert "| 2-core AMD EPYC, AVX-512 VNNI |" in line
    assert f"[decode_decompose.md](../../results/{source.name}/decode_decompose.md)" in line
