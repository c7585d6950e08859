"""vllm_omni_edge_bench/harness/omni_stages.py without vLLM: attribution, evidence checks, summary, report."""

from __future__ import annotations

import pytest

from vllm_omni_edge_bench.harness import omni_stages as om

MIB = 1 << 20


def mem(pss_mib: int, anon_mib: int) -> dict:
    return {"pss": pss_mib * MIB, "pss_anon": anon_mib * MIB, "pss_file": (pss_mib - anon_mib) * MIB}


def fake_tree() -> dict[str, dict]:
    """summarise_ledger()["processes"] of one pass: the pass process (Omni), three stage engine
    cores, each with a worker below it, a resource tracker, and a worker that left before steady."""
    procs = [
        (100, 1, "python -m vllm_omni_edge_bench.harness.omni_stages pass --model m", mem(300, 250)),
        (101, 100, "python -c from multiprocessing.resource_tracker import main;main(5)", mem(10, 8)),
        (110, 100, "VLLM::StageEngineCoreProc_stage0_replica0", mem(200, 150)),
        (111, 110, "VLLM::Worker", mem(700, 600)),
        (120, 100, "VLLM::StageEngineCoreProc_stage1_replica0", mem(210, 160)),
        (121, 120, "VLLM::Worker", mem(400, 330)),
        (130, 100, "VLLM::StageEngineCoreProc_stage2_replica0", mem(220, 170)),
        (131, 130, "VLLM::Worker", mem(350, 300)),
    ]
    return {str(pid): {"pid": pid, "ppid": ppid, "title": title, "steady": record, "peak": record}
            for pid, ppid, title, record in procs}


def test_stage_titles_name_the_stage():
    assert om.stage_of_title("VLLM::StageEngineCoreProc_stage2_replica0") == 2
    assert om.stage_of_title("VLLM::StageEngineCoreProc_stage10_replica1") == 10
    assert om.stage_of_title("VLLM::EngineCore") is None
    assert om.stage_of_title("") is None


def test_workers_are_attributed_to_their_stage_and_the_rest_to_frontend_or_other():
    labels = om.attribute_stages(fake_tree(), root_pid=100)
    assert labels == {100: "frontend", 101: "frontend", 110: "stage0", 111: "stage0", 120: "stage1",
                      121: "stage1", 130: "stage2", 131: "stage2"}


def test_the_evidence_role_names_the_stage_when_the_title_does_not():
    tree = fake_tree()
    tree["110"]["title"] = "python -c from multiprocessing.spawn import spawn_main"
    tree["110"]["evidence_role"] = "StageEngineCoreProc_stage0_replica0"
    labels = om.attribute_stages(tree, root_pid=100)
    assert labels[110] == labels[111] == "stage0"


def test_a_process_outside_the_root_is_other():
    tree = fake_tree()
    tree["200"] = {"pid": 200, "ppid": 5, "title": "orphan", "steady": mem(1, 1)}
    assert om.attribute_stages(tree, root_pid=100)[200] == "other"


def test_group_memory_sums_the_stage_processes():
    tree = fake_tree()
    groups = om.group_memory(tree, om.attribute_stages(tree, 100))
    assert groups["stage0"]["pss"] == 900 * MIB
    assert groups["stage0"]["pss_anon"] == 750 * MIB
    assert groups["stage0"]["pss_file"] == 150 * MIB
    assert sorted(groups["stage0"]["pids"]) == [110, 111]
    assert groups["frontend"]["pss"] == 310 * MIB  # the pass process and its resource tracker
    assert sum(g["pss"] for g in groups.values()) == sum(p["steady"]["pss"] for p in tree.values())


def test_a_member_without_a_steady_record_is_reported_missing_and_unknown_fields_stay_none():
    tree = fake_tree()
    tree["121"]["steady"] = None
    tree["131"]["steady"] = {"pss": 5 * MIB, "pss_anon": None, "pss_file": None}
    groups = om.group_memory(tree, om.attribute_stages(tree, 100))
    assert groups["stage1"]["missing"] == [121]
    assert groups["stage2"]["pss_anon"] is None and groups["stage2"]["pss"] == 225 * MIB


def test_stage_latency_rows_read_vllm_omni_summary():
    summary = {
        "overall_summary": {"e2e_stage_0_wall_time_ms": 120.0, "e2e_stage_1_wall_time_ms": 900.0},
        "stage_table": [{"request_id": "0_x", "stages": [
            {"stage_id": 0, "stage_gen_time_ms": 100.0, "num_tokens_out": 8},
            {"stage_id": 1, "stage_gen_time_ms": 850.0, "num_tokens_out": 48},
            {"stage_id": 2, "stage_gen_time_ms": 2000.0, "num_tokens_out": 0},
        ]}],
    }
    rows = om.stage_latency_rows(summary)
    assert rows[0] == {"gen_ms": 100.0, "tokens_out": 8, "wall_ms": 120.0}
    assert rows[2]["wall_ms"] is None and rows[2]["gen_ms"] == 2000.0
    assert om.stage_latency_rows({}) == {}


def worker(pid: int, stage: int, int4: bool) -> dict:
    kernels = ({"linear:int4pack": 14, "lm_head:int4pack": 1, "fallback": 0, "dense_prefill_copy": 0, "group_codes": 0,
                "six_bit": 0}
               if int4 else {})
    return {"pid": pid, "omni_stage_id": stage, "quantization": "cpu_int4" if int4 else None,
            "cpu_int4_kernels": kernels}


LABELS = {111: "stage0", 121: "stage1", 131: "stage2"}


def test_int4_arm_needs_int4_kernels_in_thinker_and_talker_workers_only():
    good = {"workers": [worker(111, 0, True), worker(121, 1, True), worker(131, 2, False)]}
    assert om.arm_evidence_problems("int4", good, LABELS) == []
    plain = {"workers": [worker(111, 0, False), worker(121, 1, True), worker(131, 2, False)]}
    problems = om.arm_evidence_problems("int4", plain, LABELS)
    assert len(problems) == 1 and "stage 0" in problems[0] and "cpu_int4" in problems[0]


def test_bf16_arm_refuses_int4_kernels_and_missing_stage_evidence():
    evidence = {"workers": [worker(111, 0, True), worker(121, 1, False)]}
    problems = om.arm_evidence_problems("bf16", evidence, LABELS)
    assert any("stage 0" in p and "asks for none" in p for p in problems)
    assert any("no worker evidence from stage 2" in p for p in problems)


def test_evidence_from_a_process_the_ledger_puts_elsewhere_is_a_problem():
    evidence = {"workers": [worker(111, 1, False), worker(121, 0, False), worker(131, 2, False)]}
    problems = om.arm_evidence_problems("bf16", evidence, LABELS)
    assert any("attributes to stage0" in p for p in problems)


def pass_record(arm: str, index: int, status: str = "ok", scale: float = 1.0) -> dict:
    tree = fake_tree()
    steady = om.group_memory(tree, om.attribute_stages(tree, 100))
    stages = {str(s): {"gen_ms": (s + 1) * 100.0 * scale, "wall_ms": None, "tokens_out": 8} for s in om.STAGES}
    return {"arm": arm, "pass_index": index, "status": status, "reasons": [] if status == "ok" else ["boom"],
            "memory": {"steady": steady, "tree_steady": {"pss": 2090 * MIB, "pss_anon": 1, "pss_file": 1}},
            "latency": {"request_ms": 1000.0 * scale, "stages": stages},
            "cpu_int4_kernels_by_stage": {"0": {"linear:int4pack": 14}, "1": {"linear:int4pack": 8}, "2": {}}
            if arm == "int4" else {"0": {}, "1": {}, "2": {}},
            "cpu_int4_other_layers": []}


def test_summary_gives_median_and_spread_per_arm_and_stage():
    records = [pass_record(arm, i, scale=i) for i in (1, 2, 3) for arm in ("bf16", "int4")]
    summary = om.summarise_passes(records, ["bf16", "int4"], 3)
    assert summary["status"] == "ok"
    stage1 = summary["arms"]["int4"]["latency"]["1"]["gen_ms"]
    assert stage1 == {"median": 400.0, "min": 200.0, "max": 600.0, "n": 3}
    assert summary["arms"]["bf16"]["memory_steady"]["stage0"]["pss"]["median"] == 900 * MIB
    assert summary["arms"]["bf16"]["latency"]["request_ms"]["median"] == 2000.0


@pytest.mark.parametrize(("bad_status", "expected"), [("crashed", "crashed"), ("invalid", "invalid")])
def test_a_bad_pass_makes_the_artifact_refuse_medians(bad_status, expected):
    records = [pass_record("bf16", 1), pass_record("int4", 1, status=bad_status)]
    summary = om.summarise_passes(records, ["bf16", "int4"], 1)
    assert summary["status"] == expected and summary["arms"] is None
    assert any("int4" in r and "boom" in r for r in summary["reasons"])
    markdown = om.render_markdown({"summary": summary, "run": {"started": "2026-11-30T21:00", "arms": ["bf16"],
                                                                "passes": 1, "requests": 3, "busy_box": False}})
    assert f"Status: {expected}" in markdown and "| arm |" not in markdown


def test_passes_not_run_make_the_artifact_incomplete():
    summary = om.summarise_passes([pass_record("bf16", 1)], ["bf16", "int4"], 2)
    assert summary["status"] == "incomplete"
    assert "pass 1 int4: not run" in summary["reasons"] and "pass 2 bf16: not run" in summary["reasons"]


def test_report_has_a_row_per_stage_and_labels_a_busy_box():
    records = [pass_record(arm, 1) for arm in ("bf16", "int4")]
    artifact = {"summary": om.summarise_passes(records, ["bf16", "int4"], 1),
                "run": {"started": "2026-11-30T21:00", "arms": ["bf16", "int4"], "passes": 1, "requests": 3,
                        "busy_box": True}}
    markdown = om.render_markdown(artifact)
    assert "busy box" in markdown
    assert "| int4 | stage 1 (talker) | 610 [610–610] | 490 [490–490] | 120 [120–120] |" in markdown
    assert "| int4 | stage 0 (thinker) | 900 [900–900] | 750 [750–750] | 150 [150–150] |" in markdown
    assert "| bf16 | stage 2 (code2wav) | 300 [300–300] | 8 |" in markdown
    assert "cpu_int4 in arm int4" in markdown and "cpu_int4 in arm bf16" not in markdown
    assert "- stage 1 (talker): {'linear:int4pack': 8}" in markdown
    assert "no layer was left unquantized" in markdown


def test_unknown_arm_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown arm.*fp8.*bf16, int4"):
        om.run(["fp8"], 1, tmp_path / "out", tmp_path, 1, 10, 0.5, 1, False)
