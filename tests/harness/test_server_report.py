"""What server passes add to the ledger and the report: a client outside the tree totals,
and the agent tasks table."""

from vllm_omni_edge_bench.harness.ledger import HARNESS_CLIENT, canonical_role, summarise_ledger
from vllm_omni_edge_bench.harness.report import _agent_table, format_value
from tests.harness.test_ledger import synthetic_ledger


def test_the_harness_client_is_listed_but_not_in_the_tree_totals():
    # Root pid 1 is the pass process; as a server pass's client it names itself in its evidence.
    plain = summarise_ledger(synthetic_ledger(), first_token_t=1004.0, workloads_done_t=1010.0)
    client = summarise_ledger(synthetic_ledger(), roles={1: HARNESS_CLIENT},
                              first_token_t=1004.0, workloads_done_t=1010.0)
    assert plain["tree"]["steady"]["pss"] == 600 and plain["excluded_from_tree"] == []
    assert client["tree"]["steady"]["pss"] == 500  # the worker alone
    assert client["tree"]["peak_load"]["pss"] == 900
    assert client["excluded_from_tree"] == [1]
    assert client["processes"]["1"]["role"] == HARNESS_CLIENT
    assert client["processes"]["1"]["steady"]["pss"] == 100  # still measured, per process
    assert all("1" not in sample["pss"] for sample in client["timeline"])
    assert canonical_role(HARNESS_CLIENT, is_root=True) == HARNESS_CLIENT


def _agent_pass(arm, passed):
    tasks = [{"id": tid, "category": "c", "mode": "named", "passed": ok} for tid, ok in passed.items()]
    return {"arm": arm, "result": {"workloads": [{"label": "agent", "agent": {"tasks": tasks}},
                                                 {"label": "tg16", "figures": {}}]}}


def test_agent_table_counts_passes_per_task_and_arm():
    art = {"grid": {"arms": [{"name": "bf16"}, {"name": "int4"}]},
           "passes": [_agent_pass("bf16", {"t1": True, "t2": False}), _agent_pass("int4", {"t1": False, "t2": False}),
                      _agent_pass("bf16", {"t1": True, "t2": True}), _agent_pass("int4", {"t1": True, "t2": False})]}
    lines = _agent_table(art)
    assert "| agent | t1 | c | named | 2/2 | 1/2 |" in lines
    assert "| agent | t2 | c | named | 1/2 | 0/2 |" in lines
    assert _agent_table({"grid": art["grid"], "passes": [{"arm": "bf16", "result": None}]}) == []


def test_new_units_format():
    assert format_value(0.25, "fraction") == "0.250"
    assert format_value(4, "requests") == "4 requests"
    assert format_value(2.5, "req/s") == "2.5 req/s"
