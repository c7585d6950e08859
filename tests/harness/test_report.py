"""report.md and PNGs from artifacts made by the runner (with fake_pass), and the CLI."""

import json

import pytest

from vllm_omni_edge_bench.harness import cli, runner
from vllm_omni_edge_bench.harness.report import load_artifacts, render_markdown, resummarise, write_report
from tests.harness.conftest import fake_grid, quiet_options


def make_results(tmp_path, a, b, **options):
    out = tmp_path / "results"
    runner.run_grid(fake_grid(tmp_path, a, b), "name: unit\n", out, quiet_options(**options))
    return out


def test_report_of_a_clean_grid(tmp_path, fake_engine):
    out = make_results(tmp_path, {"tok_s": [10, 20, 40]}, {"tok_s": [5, 10, 20]})
    path = write_report(out)
    text = path.read_text()
    assert text.startswith("# unit: ok")
    assert "| a | tg16 (↑) | 20.0 tok/s | 10.0 tok/s – 40.0 tok/s | control |" in text
    assert "| b | tg16 (↑) | 10.0 tok/s | 5.0 tok/s – 20.0 tok/s | 0.500× (0.500–0.500) |" in text
    assert "FAKE, compiled, weights bfloat16" in text  # the backend comes from the worker's evidence
    assert "| a | worker | `" in text and "| a | frontend | `" in text  # memory per process, by role
    assert (out / "figures.png").stat().st_size > 0 and (out / "memory-timeline.png").stat().st_size > 0


def test_report_of_a_crashed_grid_has_reasons_and_no_medians(tmp_path, fake_engine):
    out = make_results(tmp_path, {}, {"fake": "crash"})
    text = write_report(out).read_text()
    assert text.startswith("# unit: crashed")
    assert "No medians" in text and "exited with code 3" in text
    assert "median" not in text.replace("No medians", "")
    assert not (out / "figures.png").exists()


def test_report_recomputes_a_missing_summary_as_not_ok(tmp_path, fake_engine):
    out = make_results(tmp_path, {}, {})
    (out / "summary.json").unlink()
    for stem in ("03-a", "03-b"):
        (out / "passes" / f"{stem}.json").unlink()  # as if the run was cut short
    art = load_artifacts(out)
    assert art["summary"]["status"] == "incomplete"
    assert "No medians: the grid is incomplete" in render_markdown(art)


def test_resummarise_rebuilds_a_stale_summary_from_the_pass_records(tmp_path, fake_engine):
    out = make_results(tmp_path, {"tok_s": [10, 20, 40]}, {"tok_s": [5, 10, 20]})
    fresh = json.loads((out / "summary.json").read_text())
    stale = json.loads(json.dumps(fresh))
    del stale["arms"]["a"]["tg16"]  # as if written by a harness that had no such figure
    (out / "summary.json").write_text(json.dumps(stale))
    assert "tg16" not in load_artifacts(out)["summary"]["arms"]["a"]
    assert resummarise(out) == fresh
    assert json.loads((out / "summary.json").read_text()) == fresh


def test_cli_help_lists_every_axis(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    for axis in ("--passes", "--out", "--rotate", "--keep-going", "--timeout-s", "llm_kwargs", "expect", "env",
                 "rotate_start", "timeout_s", "gen_tokens", "prompt_tokens", "cold_start", "server", "clients"):
        assert axis in text, axis


def test_cli_refuses_too_few_passes_and_bad_grids(tmp_path, capsys):
    grid = tmp_path / "g.yaml"
    grid.write_text("name: g\ncontrol: a\narms: [{name: a, model: /tmp}]\nworkloads: [cold_start]\n")
    assert cli.main(["run", str(grid), "--passes", "2", "--check"]) == cli.EXIT_BAD_GRID
    assert "passes" in capsys.readouterr().err
    assert cli.main(["run", str(grid), "--check"]) == cli.EXIT_OK
    grid.write_text("name: g\ncontrol: a\narms: [{name: a, modle: /tmp}]\nworkloads: [cold_start]\n")
    assert cli.main(["run", str(grid), "--check"]) == cli.EXIT_BAD_GRID
    assert "arms.0.modle: unknown key" in capsys.readouterr().err


def test_cli_run_then_report(tmp_path, fake_engine, capsys):
    grid = tmp_path / "g.yaml"
    grid.write_text(f"name: g\ncontrol: a\narms: [{{name: a, model: {tmp_path}}}, {{name: b, model: {tmp_path}}}]\n"
                    "workloads: [{decode: {gen_tokens: 16}}]\n")
    out = tmp_path / "out"
    assert cli.main(["run", str(grid), "--out", str(out), "--rotate", "--sample-interval-ms", "50"]) == cli.EXIT_OK
    assert (out / "report.md").exists()
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["overrides"] == {"rotate_start": True}
    order = [json.loads(p.read_text())["arm"] for p in sorted((out / "passes").glob("*.json"),
                                                               key=lambda p: json.loads(p.read_text())["seq"])]
    assert order == ["a", "b", "b", "a", "a", "b"]
    (out / "report.md").unlink()
    assert cli.main(["report", str(out)]) == cli.EXIT_OK and (out / "report.md").exists()


def test_memory_breakdown_takes_weights_and_an_eager_kv_out_of_the_tree():
    from vllm_omni_edge_bench.harness.report import memory_breakdown_row

    mib = 1 << 20
    worker = {"weights_bytes_by_class": {"linear": 60 * mib, "embedding": 30 * mib, "head": 0, "other": 1 * mib},
              "kv_cache_bytes": 100 * mib, "kv_cache_mapped_bytes": 0}
    row = memory_breakdown_row("a", [{"evidence": {"workers": [worker]}, "result": {}}], 500 * mib)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "a" and cells[-1] == "309.0 MiB"  # 500 - 91 weights - 100 KV
    lazy = dict(worker, kv_cache_mapped_bytes=100 * mib)
    row = memory_breakdown_row("b", [{"evidence": {"workers": [lazy]}, "result": {}}], 500 * mib)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2].endswith("(resident as used)") and cells[-1] == "409.0 MiB"  # the KV's written part stays in


def test_memory_breakdown_row_of_llamacpp_has_the_same_columns():
    from vllm_omni_edge_bench.harness.report import memory_breakdown_row

    row = memory_breakdown_row("l", [{"evidence": {"workers": [{"model_size_bytes": 90 << 20}]},
                                      "result": {"engine": "llamacpp"}}], 200 << 20)
    assert row.count("|") == 9 and row.strip().endswith("110.0 MiB |")
