import pytest

from vllm_omni_edge_bench.harness.stats import figures_of_pass, summarise


def record(arm, pass_index, tok_s=None, status="ok", reasons=(), steady_pss=None, roles=None):
    figures = {} if tok_s is None else {"tg128": {"value": tok_s, "unit": "tok/s", "better": "higher", "source": "t"}}
    ledger = None
    if steady_pss is not None:
        window = {"pss": steady_pss, "pss_anon": steady_pss // 2}
        processes = {str(i): {"role": role, "steady": {"pss": pss}} for i, (role, pss) in enumerate((roles or {}).items())}
        ledger = {"tree": {"steady": window, "peak": window, "peak_load": None}, "processes": processes}
    return {"arm": arm, "pass_index": pass_index, "seq": 0, "status": status, "reasons": list(reasons),
            "result": {"workloads": [{"figures": figures}]}, "ledger": ledger}


def grid_of(values: dict[str, list[float]]):
    return [record(arm, i + 1, v) for arm, series in values.items() for i, v in enumerate(series)]


def test_median_min_max_per_arm():
    summary = summarise(grid_of({"a": [10, 30, 20], "b": [5, 7, 6]}), ["a", "b"], "a", 3)
    assert summary["status"] == "ok"
    tg = summary["arms"]["a"]["tg128"]
    assert (tg["median"], tg["min"], tg["max"], tg["n"]) == (20, 10, 30, 3)
    assert tg["values"] == [10, 30, 20]  # in pass order


def test_ratio_is_paired_pass_by_pass_not_a_ratio_of_medians():
    # The box slows down over the run; arm b is always exactly half of the control.
    summary = summarise(grid_of({"a": [10, 20, 40], "b": [5, 10, 20]}), ["a", "b"], "a", 3)
    ratio = summary["arms"]["b"]["tg128"]["ratio_vs_control"]
    assert ratio["median"] == ratio["min"] == ratio["max"] == pytest.approx(0.5)
    # A pairing mistake (b's passes matched to other control passes) would spread it.
    shuffled = summarise(grid_of({"a": [10, 20, 40], "b": [20, 5, 10]}), ["a", "b"], "a", 3)
    assert shuffled["arms"]["b"]["tg128"]["ratio_vs_control"]["max"] == pytest.approx(2.0)
    assert "ratio_vs_control" not in summary["arms"]["a"]["tg128"]


def test_even_number_of_passes_takes_the_middle_mean():
    summary = summarise(grid_of({"a": [1, 2, 3, 10]}), ["a"], "a", 4)
    assert summary["arms"]["a"]["tg128"]["median"] == 2.5


@pytest.mark.parametrize("bad_status, expected", [("crashed", "crashed"), ("invalid", "invalid")])
def test_one_bad_pass_refuses_all_medians(bad_status, expected):
    records = grid_of({"a": [10, 11, 12], "b": [5, 6, 7]})
    records[4] = record("b", 2, None, status=bad_status, reasons=["exited with code 1"])
    summary = summarise(records, ["a", "b"], "a", 3)
    assert summary["status"] == expected
    assert "arms" not in summary and "median" not in str(summary)
    assert summary["reasons"] == [f"pass 2 arm b {bad_status}: exited with code 1"]
    assert summary["pass_counts"][bad_status] == 1


def test_crashed_outranks_invalid_and_every_reason_is_kept():
    records = grid_of({"a": [10, 11, 12], "b": [5, 6, 7]})
    records[3] = record("b", 1, status="invalid", reasons=["compiled: expected False"])
    records[1] = record("a", 2, status="crashed", reasons=["timed out after 600 s", "log: ..."])
    summary = summarise(records, ["a", "b"], "a", 3)
    assert summary["status"] == "crashed" and len(summary["reasons"]) == 3


def test_passes_that_did_not_run_make_the_grid_incomplete():
    records = grid_of({"a": [10, 11, 12], "b": [5, 6]})
    summary = summarise(records, ["a", "b"], "a", 3)
    assert summary["status"] == "incomplete" and "3-b" in summary["reasons"][0]
    records.append(record("b", 3, status="not_run", reasons=["interrupted"]))
    assert summarise(records, ["a", "b"], "a", 3)["status"] == "incomplete"


def test_a_figure_missing_from_one_pass_is_not_summarised():
    records = grid_of({"a": [10, 11, 12]})
    records[0]["result"]["workloads"][0]["figures"]["tg128 (engine)"] = {
        "value": 9, "unit": "tok/s", "better": "higher", "source": "engine"}
    summary = summarise(records, ["a"], "a", 3)
    assert "tg128 (engine)" not in summary["arms"]["a"]
    assert any("tg128 (engine)" in note for note in summary["notes"])


def test_memory_figures_come_from_the_tree_and_roles():
    figures = figures_of_pass(record("a", 1, 10, steady_pss=3000,
                                     roles={"frontend": 1000, "engine_core": 800, "worker": 1200}))
    assert figures["tree PSS steady"]["value"] == 3000
    assert figures["tree PSS_Anon steady"]["value"] == 1500
    assert figures["worker PSS steady"]["value"] == 1200
    assert figures["tree PSS steady"]["better"] == "lower"
    assert "tree PSS load peak" not in figures  # no first-token marker, no load window


def test_cpu_per_role_while_the_workloads_ran():
    rec = record("a", 1, 10, steady_pss=3000, roles={"engine_core": 800, "worker": 1200})
    processes = rec["ledger"]["processes"]
    processes["0"]["cpu_s"] = {"total": 40.0, "during_workloads": 9.5}
    processes["1"]["cpu_s"] = {"total": 50.0, "during_workloads": None}  # no markers: no figure
    figures = figures_of_pass(rec)
    assert figures["engine_core CPU s in workloads"]["value"] == 9.5
    assert figures["engine_core CPU s in workloads"]["unit"] == "s"
    assert "worker CPU s in workloads" not in figures


def test_workload_peak_is_read_between_first_token_and_workloads_done():
    rec = record("a", 1, 10, steady_pss=3000)
    rec["ledger"].update(first_token_s=10.0, workloads_done_s=20.0, timeline=[
        {"t": 5.0, "pss": {"1": 4000, "2": 900}},   # loading: the load peak, not serving
        {"t": 12.0, "pss": {"1": 2000, "2": 1100}},
        {"t": 15.0, "pss": {"1": 2100, "2": 1150}},  # the serving peak: 3,250
        {"t": 25.0, "pss": {"1": 3900}},             # after the workloads
    ])
    figures = figures_of_pass(rec)
    assert figures["tree PSS workload peak"]["value"] == 3250
    del rec["ledger"]["workloads_done_s"]
    assert "tree PSS workload peak" not in figures_of_pass(rec)  # no end marker, no window
