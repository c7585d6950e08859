from pathlib import Path

import pytest

from vllm_omni_edge_bench.harness.grid import GridError, describe_axes, load_grid, parse_grid, resolve_model
from tests.harness.conftest import grid_dict

GRIDS = Path(__file__).resolve().parents[2] / "vllm_omni_edge_bench" / "harness" / "grids"


def error_of(data) -> str:
    with pytest.raises(GridError) as caught:
        parse_grid(data)
    return str(caught.value)


def test_a_valid_grid_parses_with_defaults():
    grid = parse_grid(grid_dict())
    assert grid.passes == 3 and grid.control == "a" and not grid.rotate_start
    assert grid.workloads[0].gen_tokens == 16 and grid.workloads[0].label == "tg16"
    assert grid.arms[0].engine == "vllm"


def test_fewer_than_three_passes_is_refused():
    assert "passes" in error_of(grid_dict(passes=2))


@pytest.mark.parametrize(
    "data, where",
    [
        (grid_dict(pases=3), "pases: unknown key"),
        (grid_dict(arms=[{"name": "a", "llm_kwarg": {}}]), "arms.0.llm_kwarg: unknown key"),
        (grid_dict(workloads=[{"decode": {"gen_tokns": 16}}]), "workloads.0.decode.gen_tokns: unknown key"),
    ],
)
def test_unknown_keys_are_errors_naming_the_key(data, where):
    assert where in error_of(data)


def test_unknown_workload_kind_lists_the_known_ones():
    message = error_of(grid_dict(workloads=["decodee"]))
    assert "workloads.0" in message and "cold_start" in message


def test_control_must_be_an_arm_and_names_unique():
    assert "control 'zz' is not an arm" in error_of(grid_dict(control="zz"))
    twins = [{"name": "a"}, {"name": "a"}]
    assert "repeated: a" in error_of(grid_dict(arms=twins))


def test_kv_cache_size_accepts_human_sizes():
    data = grid_dict()
    data["arms"][0]["llm_kwargs"]["kv_cache_memory_bytes"] = "192MiB"
    data["arms"][1]["llm_kwargs"]["kv_cache_memory_bytes"] = "1GiB"
    grid = parse_grid(data)
    assert grid.arm("a").llm_kwargs["kv_cache_memory_bytes"] == 201326592
    assert grid.arm("b").llm_kwargs["kv_cache_memory_bytes"] == 1 << 30


def test_a_bad_size_is_an_error():
    data = grid_dict()
    data["arms"][0]["llm_kwargs"]["kv_cache_memory_bytes"] = "192 furlongs"
    assert "192 furlongs" in error_of(data)


def test_env_values_become_strings_but_yaml_booleans_are_refused():
    data = grid_dict()
    data["arms"][0]["env"] = {"VLLM_CPU_NUM_OF_RESERVED_CPU": 0}
    assert parse_grid(data).arm("a").env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    data["arms"][0]["env"] = {"VLLM_CPU_CI_ENV": True}
    assert "VLLM_CPU_CI_ENV" in error_of(data)


def test_the_evidence_directory_belongs_to_the_harness():
    data = grid_dict()
    data["arms"][0]["env"] = {"VLLM_OMNI_EDGE_EVIDENCE_DIR": "/tmp/x"}
    assert "set by the harness" in error_of(data)


def test_model_goes_in_the_arm_not_llm_kwargs():
    data = grid_dict()
    data["arms"][0]["llm_kwargs"]["model"] = "/x"
    assert "arm's 'model'" in error_of(data)


def test_workload_must_fit_max_model_len():
    data = grid_dict(workloads=[{"prefill": {"prompt_tokens": 512}}])
    data["arms"][1]["llm_kwargs"]["max_model_len"] = 512
    message = error_of(data)
    assert "arm b" in message and "pp512" in message and "513" in message


def test_malformed_expectation_names_its_key():
    data = grid_dict()
    data["arms"][0]["expect"] = {"kv_cache_bytes": "<= lots"}
    assert "kv_cache_bytes" in error_of(data)


def test_repeated_workloads_are_refused():
    assert "tg16" in error_of(grid_dict(workloads=[{"decode": {"gen_tokens": 16}}] * 2))


def test_workload_shorthands():
    grid = parse_grid(grid_dict(workloads=["cold_start", {"prefill": None}, {"kind": "ttft", "prompt_tokens": 32}]))
    assert [w.label for w in grid.workloads] == ["cold_start", "pp512", "ttft32"]


def test_default_model_resolves_to_the_embedded_model_dir():
    from vllm_omni_edge.models.default_model import default_model_dir

    assert resolve_model("default") == str(default_model_dir())
    assert resolve_model("/models/x") == "/models/x"


@pytest.mark.parametrize("path", sorted(GRIDS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_grids_load(path):
    grid, text = load_grid(path)
    assert text == path.read_text()
    assert grid.passes >= 3 and grid.control in grid.arm_names


def test_reserved_cores_arms_differ_only_in_that_variable():
    grid, _ = load_grid(GRIDS / "reserved-cores.yaml")
    first, second = (arm.model_dump(exclude={"name"}) for arm in grid.arms)
    layout = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's three processes in both
    assert first.pop("env") == {**layout, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} and first.pop("expect") == {"torch_threads": 1}
    assert second.pop("env") == {**layout, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} and second.pop("expect") == {"torch_threads": 2}
    assert first == second
    assert {w.label for w in grid.workloads} == {"tg128", "pp512"}


def test_describe_axes_lists_every_field():
    from vllm_omni_edge_bench.harness.grid import Arm, Grid, ServerWorkload

    text = describe_axes()
    for model in (Grid, Arm, ServerWorkload):
        for name in model.model_fields:
            if name != "kind":
                assert f"{name}:" in text, name
