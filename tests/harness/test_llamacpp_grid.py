"""llamacpp arms in grids: validation, model resolution, plan-time refusals, evidence checks."""

from __future__ import annotations

import pytest

from vllm_omni_edge_bench.harness import runner
from vllm_omni_edge_bench.harness.evidence import evidence_problems
from vllm_omni_edge_bench.harness.grid import GridError, parse_grid, resolve_arm_model
from vllm_omni_edge_bench.baselines.llamacpp import parse_llama_log

WORKLOADS = ["cold_start", {"decode": {"prompt_tokens": 16, "gen_tokens": 16}}, {"prefill": {"prompt_tokens": 64}}]


def grid_with(*arms, workloads=WORKLOADS, control=None):
    return {"name": "g", "control": control or arms[0]["name"], "arms": list(arms), "workloads": workloads}


def test_llamacpp_arm_gets_default_settings_and_keeps_vllm_arms_unchanged():
    grid = parse_grid(grid_with({"name": "us", "llm_kwargs": {"enforce_eager": True}},
                                {"name": "llama", "engine": "llamacpp", "llamacpp": {"n_threads": 2, "use_mmap": False}},
                                {"name": "llama-defaults", "engine": "llamacpp"}))
    assert grid.arm("us").llamacpp is None
    assert grid.arm("llama").llamacpp.n_threads == 2
    assert grid.arm("llama").llamacpp.use_mmap is False
    defaults = grid.arm("llama-defaults").llamacpp
    assert defaults is not None and defaults.use_mmap is True and defaults.use_extra_bufts is None
    assert defaults.tokenizer == "default"  # an embedded model's GGUF reads with that model's tokenizer


def test_a_gguf_path_needs_its_tokenizer_named():
    arm = {"name": "a", "engine": "llamacpp", "model": "/m/x.Q4_0.gguf"}
    with pytest.raises(GridError, match="set llamacpp.tokenizer"):
        parse_grid(grid_with(arm))
    grid = parse_grid(grid_with({**arm, "llamacpp": {"tokenizer": "default"}}))
    assert grid.arm("a").llamacpp.tokenizer == "default"


@pytest.mark.parametrize("arm, message", [
    ({"name": "a", "engine": "llamacpp", "llamacpp": {"n_thread": 2}}, "arms.0.llamacpp.n_thread: unknown key"),
    ({"name": "a", "engine": "llamacpp", "llm_kwargs": {"enforce_eager": True}}, "llm_kwargs are vllm.LLM arguments"),
    ({"name": "a", "llamacpp": {"n_threads": 2}}, "set engine: llamacpp"),
    ({"name": "a", "engine": "llamacpp", "model": "/models/SmolLM2"}, "is a .gguf file or an embedded model name"),
    ({"name": "a", "engine": "llamacpp", "llamacpp": {"flash_attn": "yes"}}, "flash_attn"),
    ({"name": "a", "engine": "llamacpp", "llamacpp": {"n_threads": 0}}, "n_threads"),
])
def test_bad_llamacpp_arms_are_refused_naming_the_problem(arm, message):
    with pytest.raises(GridError, match=message):
        parse_grid(grid_with(arm))


def test_workload_longer_than_n_ctx_is_refused():
    arm = {"name": "a", "engine": "llamacpp", "llamacpp": {"n_ctx": 64}}
    with pytest.raises(GridError, match=r"pp64 needs 65 tokens of context but llamacpp.n_ctx is 64"):
        parse_grid(grid_with(arm))


def test_llamacpp_fidelity_needs_no_max_logprobs():
    fidelity = [{"fidelity": {"top_k": 64}}]
    parse_grid(grid_with({"name": "a", "engine": "llamacpp"}, workloads=fidelity))
    with pytest.raises(GridError, match="max_logprobs"):
        parse_grid(grid_with({"name": "b"}, workloads=fidelity))


def test_embedded_name_resolves_to_the_shipped_gguf_for_llamacpp_only(isolated_cache):
    grid = parse_grid(grid_with({"name": "us"}, {"name": "llama", "engine": "llamacpp"},
                                {"name": "file", "engine": "llamacpp", "model": "~/m/x.Q4_0.gguf",
                                 "llamacpp": {"tokenizer": "default"}}))
    assert resolve_arm_model(grid.arm("llama")).endswith("gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_arm_model(grid.arm("llama")).startswith(str(isolated_cache))
    assert resolve_arm_model(grid.arm("us")).endswith("models/SmolLM2-135M-Instruct")
    assert resolve_arm_model(grid.arm("file")).endswith("/m/x.Q4_0.gguf") and "~" not in resolve_arm_model(grid.arm("file"))


def test_check_runnable_names_a_missing_gguf_and_unsupported_workloads(tmp_path):
    missing = tmp_path / "absent.gguf"
    grid = parse_grid(grid_with({"name": "llama", "engine": "llamacpp", "model": str(missing),
                                 "llamacpp": {"tokenizer": "default"}},
                                workloads=WORKLOADS + [{"server": {"clients": 2}}]))
    with pytest.raises(GridError) as error:
        runner.check_runnable(grid)
    text = str(error.value)
    assert f"model {missing} does not exist" in text
    assert "workload server: not implemented for llamacpp passes yet" in text
    assert "has no pass runner" not in text


def test_llamacpp_pass_module_is_registered():
    assert runner.PASS_MODULES["llamacpp"] == "vllm_omni_edge_bench.harness.pass_llamacpp"
    assert {"decode", "prefill", "ttft", "cold_start", "fidelity"} == runner.IMPLEMENTED_WORKLOADS["llamacpp"]


CANNED_LOG = """\
print_info: file type   = Q4_1
load_tensors:   CPU_Mapped model buffer size =    87.60 MiB
load_tensors:   CPU_REPACK model buffer size =    60.75 MiB
llama_context: n_ctx         = 2048
llama_context: flash_attn    = auto
llama_kv_cache:        CPU KV buffer size =    45.00 MiB
llama_context:        CPU compute buffer size =    98.07 MiB
""".splitlines()


def worker_evidence(lines=CANNED_LOG, **overrides):
    return {"pid": 42, "n_threads": 2, "use_mmap": True, "use_extra_bufts": True, **parse_llama_log(lines), **overrides}


def evidence_of(worker):
    return {"dir": "/tmp/e", "processes": [], "workers": [worker], "unreadable": []}


def test_expectations_on_llamacpp_evidence_pass_and_fail_like_vllm_workers():
    grid = parse_grid(grid_with({"name": "llama", "engine": "llamacpp", "expect": {
        "n_threads": 2, "weights_mmapped": True, "buffers.model.CPU_REPACK": ">0", "buffers.KV.CPU": "45MiB"}}))
    expect = grid.arm("llama").expect
    assert evidence_problems(evidence_of(worker_evidence()), expect, tree_pids={42}) == []

    no_repack = worker_evidence(CANNED_LOG[:2] + CANNED_LOG[3:], n_threads=1)
    problems = evidence_problems(evidence_of(no_repack), expect, tree_pids={42})
    assert any("n_threads: expected 2, evidence says 1" in p for p in problems)
    assert any("evidence has no buffers.model.CPU_REPACK" in p for p in problems)


def test_an_amx_buffer_is_caught_by_an_expectation():
    grid = parse_grid(grid_with({"name": "llama", "engine": "llamacpp",
                                 "expect": {"weight_buffers": "CPU_Mapped+CPU_REPACK", "amx_weights": False}}))
    expect = grid.arm("llama").expect
    assert evidence_problems(evidence_of(worker_evidence()), expect, tree_pids={42}) == []

    amx = worker_evidence(CANNED_LOG + ["load_tensors:          AMX model buffer size =    70.00 MiB"])
    assert amx["weight_buffer_types"] == ["AMX", "CPU_Mapped", "CPU_REPACK"]
    problems = evidence_problems(evidence_of(amx), expect, tree_pids={42})
    assert any("weight_buffers: expected 'CPU_Mapped+CPU_REPACK', evidence says 'AMX+CPU_Mapped+CPU_REPACK'" in p
               for p in problems)
    assert any("amx_weights: expected False, evidence says True" in p for p in problems)
