"""step_ab: its lever switches, its report, and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_omni_edge_bench.harness import provenance
from vllm_omni_edge_bench.harness import step_ab


def test_the_graph_args_lever_switches_off_and_back():
    from vllm_omni_edge.patches.worker import compiled_graph_args as patch

    planned = patch.Memo.__call__
    lever = step_ab.LEVERS["compiled_graph_args"]()
    try:
        lever.off()
        assert patch.Memo.__call__ is not planned
        seen = []
        memo = patch.Memo.__new__(patch.Memo)
        memo.compiled = "compiled"
        assert patch.Memo.__call__(memo, lambda *a, **k: seen.append(a) or "dynamo", ("m", 1), {}) == "dynamo"
        assert seen == [("compiled", "m", 1)]  # off: straight to dynamo's path
        lever.on()
        assert patch.Memo.__call__ is planned
    finally:
        patch.Memo.__call__ = planned


def test_the_decode_prefetch_lever_sets_the_kernels_distance_and_sees_rows16_calls():
    import torch

    from vllm_omni_edge.cpu_features import cpu_flags

    if "avx512_vnni" not in cpu_flags():
        pytest.skip("the rows16 kernel needs AVX-512 VNNI")
    lever = step_ab.LEVERS["decode_prefetch"]()  # loads the kernel library
    distance = torch.ops.edge_cpu_int4.rows16_decode_prefetch
    default = distance(0)
    try:
        assert default > 0
        distance(default)
        lever.off()
        assert distance(default) == 0  # off: no prefetch (and back on for the next check)
        lever.on()
        assert distance(default) == default
        assert not lever.acted()  # no rows16 call yet
        from vllm_omni_edge.quantization import int4
        from vllm_omni_edge.quantization.kernels.w4a8_avx512 import interleave_rows16

        q, scales, offsets = int4.quantize(torch.randn(32, 64), 32)
        torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm(torch.randn(1, 64, dtype=torch.bfloat16),
                                                    *interleave_rows16(q, scales, offsets), 32, None, None)
        assert lever.acted()
    finally:
        distance(default)
    with pytest.raises(RuntimeError, match="blocks must be 0..64"):
        distance(65)


def test_the_decode_attention_lever_refuses_a_process_without_the_op(monkeypatch):
    pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from vllm_omni_edge.patches.worker import cpu_attention_calls as patch

    monkeypatch.setattr(patch, "decode_in_force", lambda: False)
    with pytest.raises(step_ab.StepABError, match="decode attention op is not in force"):
        step_ab.LEVERS["decode_attention"]()


def test_a_deep_prompt_repeats_the_story_prompt_to_its_length():
    class Tokenizer:
        def encode(self, text, add_special_tokens):
            assert text == step_ab.PROMPT and not add_special_tokens
            return [1, 2, 3]

    assert step_ab.prompt_ids(Tokenizer(), 7) == [1, 2, 3, 1, 2, 3, 1]


def test_the_report_leads_with_the_ratio():
    record = {"provenance": {"cpu": {"model_name": "cpu", "logical_cpus": 2}, "git": {"sha": "abc", "dirty": False}},
              "model": "m", "llm_kwargs": {"max_model_len": 512}, "levers": ["slot_mapping_call"],
              "rounds": 3, "gen_tokens": 32,
              "per_round": [{"on_ms": 5.0, "off_ms": 5.5, "ratio": 1.1}] * 3,
              "off_over_on": {"median": 1.1, "min": 1.1, "max": 1.1}}
    text = step_ab.render_markdown(record)
    assert "**Step off / on: 1.100 (1.100–1.100)**" in text and text.count("| 1.100 |") == 3


@pytest.mark.parametrize("argv, message", [
    (["--levers", "nope"], "unknown ['nope']"),
    (["--levers", ""], "none given"),
    (["--levers", "slot_mapping_call", "--rounds", "2"], "--rounds must be at least 3"),
    (["--levers", "slot_mapping_call", "--gen-tokens", "8"], "--gen-tokens must be at least 16"),
    (["--levers", "decode_attention", "--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    (["--levers", "slot_mapping_call", "--llm-kwargs", '{"model": "x"}'], "without 'model'"),
    (["--levers", "slot_mapping_call", "--model", "/nonexistent/model"], "does not exist"),
])
def test_bad_arguments_are_refused_naming_the_problem(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        step_ab.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_step_ab_on_the_default_model(tmp_path):
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    pull_cpu_int4_model(DEFAULT_MODEL)
    out = tmp_path / "ab"
    done = subprocess.run([sys.executable, "-m", "vllm_omni_edge_bench.harness.step_ab",
                           "--levers", "compiled_graph_args,slot_mapping_call", "--rounds", "3",
                           "--gen-tokens", "32", "--out", str(out)],
                          cwd=provenance.PROJECT_ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "step_ab.json").read_text())
    assert len(record["per_round"]) == 3
    assert all(r["on_ms"] > 0 and r["off_ms"] > 0 for r in record["per_round"])


def test_the_sampler_argmax_lever_swaps_the_static_method():
    sampler = pytest.importorskip("vllm.v1.sample.sampler")
    import torch

    from vllm_omni_edge.patches.worker import sampler_argmax as patch

    if patch.argmax_op() is None:
        pytest.skip("kernel library not built here")
    before = sampler.Sampler.__dict__["greedy_sample"]
    patch._wrap(sampler)
    ours = sampler.Sampler.__dict__["greedy_sample"]
    try:
        lever = step_ab.LEVERS["sampler_argmax"]()
        lever.off()
        assert not patch.in_force()
        logits = torch.randn(2, 40)
        assert torch.equal(sampler.Sampler().greedy_sample(logits), logits.argmax(dim=-1))
        lever.on()
        assert patch.in_force() and sampler.Sampler.__dict__["greedy_sample"] is ours
    finally:
        sampler.Sampler.greedy_sample = before
