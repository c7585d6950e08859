"""The speech workload: grid, WER and RTF arithmetic, the stream driver, the pass with a fake engine."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.harness.conftest import quiet_options
from vllm_omni_edge_bench.harness import runner, speech
from vllm_omni_edge_bench.harness.grid import GridError, load_grid, parse_grid

GRID = Path(runner.__file__).parent / "grids" / "speech-whisper-base.yaml"


def speech_grid(**overrides) -> dict:
    data = {
        "name": "speech-unit",
        "passes": 3,
        "control": "fw",
        "arms": [{"name": "fw", "engine": "faster-whisper", "model": "whisper-base"},
                 {"name": "cpp", "engine": "whispercpp", "model": "whisper-base"}],
        "workloads": [{"speech": {"streams": [1, 2]}}],
    }
    data.update(overrides)
    return data


# --- the grid ---------------------------------------------------------------------------


def test_committed_grid_parses_with_the_three_engines_interleaved():
    grid, _ = load_grid(GRID)
    assert grid.passes >= 3
    assert grid.control == "faster-whisper-int8"
    engines = {arm.name: arm.engine for arm in grid.arms}
    assert set(engines.values()) == {"speech-server", "faster-whisper", "whispercpp"}
    serve = grid.arm("serve")
    assert serve.llm_kwargs == {} and serve.env == {} and serve.model == "whisper-base"
    int8 = grid.arm("faster-whisper-int8")
    assert (int8.faster_whisper.compute_type, int8.faster_whisper.cpu_threads) == ("int8", 2)
    assert grid.arm("whispercpp-f16").whispercpp.n_threads == 2
    (workload,) = grid.workloads
    assert workload.kind == "speech" and workload.streams == [1, 4]
    for arm in grid.arms:
        assert runner.IMPLEMENTED_WORKLOADS[arm.engine] == {"speech"}
        assert arm.engine in runner.PASS_MODULES


def test_settings_are_completed_with_their_defaults():
    grid = parse_grid(speech_grid())
    assert grid.arm("fw").faster_whisper.model_dump() == {"compute_type": "int8", "cpu_threads": 2,
                                                          "num_workers": 4, "beam_size": 1}
    assert grid.arm("cpp").whispercpp.model_dump() == {"n_threads": 2, "ftype": "f16"}
    assert grid.arm("cpp").faster_whisper is None


def test_committed_int4_grid_adds_the_cpu_int4_server_to_the_speech_grid():
    grid, _ = load_grid(GRID.with_name("speech-whisper-base-int4.yaml"))
    base, _ = load_grid(GRID)
    int4 = grid.arm("serve-cpu-int4")
    assert (int4.engine, int4.model, int4.env, int4.llm_kwargs) == ("speech-server", "whisper-base:cpu_int4", {}, {})
    assert grid.control == base.control and grid.passes == base.passes and grid.workloads == base.workloads
    # The same arms; this grid also asserts the servers' evidence (kernels, levers).
    def unexpected(arms):
        return [a.model_copy(update={"expect": {}}) for a in arms]

    added = ("serve-cpu-int4", "serve-cpu-int4-tokenizer-each")
    assert unexpected(a for a in grid.arms if a.name not in added) == unexpected(base.arms)
    assert grid.arm("serve").expect["quantization"] is None and int4.expect["quantization"] == "cpu_int4"
    assert int4.expect["processor_tokenizers.loaded"] == 0
    # The lever's A/B arm: the same command with every tokenizer load reading the files.
    each = grid.arm("serve-cpu-int4-tokenizer-each")
    assert (each.model, each.env) == (int4.model, {"VLLM_OMNI_EDGE_TOKENIZER_LOAD": "each"})
    assert each.expect["tokenizer_loads.reused"] == 0


def test_a_speech_server_arm_may_switch_one_of_our_levers():
    data = speech_grid()
    lever = {"name": "x", "engine": "speech-server", "model": "whisper-base",
             "env": {"VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER": "0"}}
    data["arms"] = [data["arms"][0], lever]
    assert parse_grid(data).arm("x").env == {"VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER": "0"}


@pytest.mark.parametrize("arm, says", [
    ({"name": "x", "engine": "faster-whisper", "model": "whisper-base:cpu_int4"}, "embedded speech model name"),
    ({"name": "x", "engine": "speech-server", "model": "default:cpu_int4"}, "embedded speech model name"),
    ({"name": "x", "engine": "whispercpp", "model": "whisper-base", "faster_whisper": {}},
     "`faster_whisper` settings on a whispercpp arm"),
    ({"name": "x", "engine": "faster-whisper", "model": "default"}, "embedded speech model name"),
    ({"name": "x", "engine": "speech-server", "model": "whisper-base", "llm_kwargs": {"enforce_eager": True}},
     "literal command"),
    ({"name": "x", "engine": "speech-server", "model": "whisper-base", "env": {"OMP_NUM_THREADS": "2"}},
     "env may only switch one of our levers"),
    ({"name": "x", "engine": "faster-whisper", "model": "whisper-base", "faster_whisper": {"compute_type": "int4"}},
     "compute_type"),
    ({"name": "x", "engine": "faster-whisper", "model": "whisper-base", "faster_whisper": {"threads": 2}},
     "unknown key"),
])
def test_bad_speech_arms_are_refused_by_name(arm, says):
    data = speech_grid()
    data["arms"] = [data["arms"][0], arm]
    with pytest.raises(GridError, match=says):
        parse_grid(data)


def test_speech_and_text_arms_cannot_share_a_grid():
    data = speech_grid()
    data["arms"].append({"name": "llm", "model": "/tmp"})
    with pytest.raises(GridError, match="speech arms"):
        parse_grid(data)


@pytest.mark.parametrize("workload, says", [
    ({"speech": {"streams": [1, 1]}}, "repeat"),
    ({"speech": {"streams": []}}, "streams"),
    ({"speech": {"fixtures": "/nonexistent/speech"}}, "sentences.txt does not exist"),
    ({"speech": {"language": "English"}}, "language"),
])
def test_bad_speech_workloads_are_refused(workload, says):
    with pytest.raises(GridError, match=says):
        parse_grid(speech_grid(workloads=[workload]))


def test_a_text_workload_on_a_speech_arm_is_refused_before_any_pass(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "resolve_arm_model", lambda arm: str(tmp_path))
    grid = parse_grid(speech_grid(workloads=[{"speech": {}}, {"decode": {"gen_tokens": 8}}]))
    with pytest.raises(GridError, match="decode: not implemented for faster-whisper"):
        runner.check_runnable(grid)


def test_a_speech_workload_on_a_text_arm_is_refused_before_any_pass(tmp_path):
    grid = parse_grid({"name": "t", "passes": 3, "control": "a", "arms": [{"name": "a", "model": str(tmp_path)}],
                       "workloads": [{"speech": {}}]})
    with pytest.raises(GridError, match="speech: not implemented for vllm"):
        runner.check_runnable(grid)


# --- fixtures, WER, RTF -----------------------------------------------------------------


def test_committed_fixtures_load_with_their_durations():
    clips = speech.load_clips()
    assert [c.key for c in clips] == ["fox", "report", "weather", "garden", "capital"]
    assert clips[0].reference == "The quick brown fox jumps over the lazy dog."
    assert clips[0].duration_s == pytest.approx(3.44, abs=0.01)


def test_a_fixture_that_is_not_16_khz_mono_is_refused(tmp_path):
    import numpy as np
    import soundfile as sf

    (tmp_path / "sentences.txt").write_text("a\tHello there.\n")
    sf.write(tmp_path / "a.wav", np.zeros((800, 2), np.int16), 8000, subtype="PCM_16")
    with pytest.raises(speech.SpeechFixtureError, match="8000 Hz, 2 channels"):
        speech.load_clips(tmp_path)


def test_normalisation_is_the_written_one():
    assert speech.normalise("  Don't  STOP—the well-known Café. ") == "don t stop the well known café"
    assert speech.normalise("ﬁve") == "five"  # NFKC


def test_wer_counts_errors_over_all_reference_words():
    refs = ["The quick brown fox.", "Hello world"]
    assert speech.wer(refs, ["the quick brown fox", "hello, world!"]) == 0.0
    assert speech.wer(refs, ["the quick brown box", "hello world"]) == pytest.approx(1 / 6)
    assert speech.wer(refs, ["quick brown fox", "hello big world"]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="2 references but 1"):
        speech.wer(refs, ["x"])


def test_tests_score_with_the_harness_normalisation():
    from tests import speech as test_speech

    assert test_speech.normalise is speech.normalise and test_speech.wer is speech.wer


def test_rtf_is_audio_seconds_per_wall_second():
    assert speech.rtf(12.0, 3.0) == 4.0
    with pytest.raises(ValueError):
        speech.rtf(12.0, 0.0)


def test_streams_start_at_different_clips_and_go_round_repeats_times():
    assert speech.stream_order(5, 0, 1) == [0, 1, 2, 3, 4]
    assert speech.stream_order(5, 3, 2) == [3, 4, 0, 1, 2, 3, 4, 0, 1, 2]


def _clips(n=3, seconds=2.0):
    return [speech.Clip(f"c{i}", Path(f"/c{i}.wav"), f"word{i} here", seconds) for i in range(n)]


def test_stream_figures_from_a_known_run():
    clips = _clips()
    requests = [{"stream": s, "clip": c.key, "audio_s": c.duration_s, "latency_s": lat, "text": c.reference,
                 "error": None} for s, (c, lat) in enumerate([(clips[0], 1.0), (clips[1], 3.0), (clips[2], 2.0)])]
    requests[1]["text"] = "wordX here"  # one substitution in 6 reference words
    run = {"streams": 3, "repeats": 1, "wall_s": 4.0, "requests": requests * 1}
    run["requests"] = requests + [dict(r, stream=r["stream"] + 3) for r in requests] * 2  # 9 = 3 clips x 3 streams
    figures, problems = speech.stream_figures("speech", run, clips)
    assert problems == []
    assert figures["speech RTF@3"]["value"] == pytest.approx(18.0 / 4.0)
    assert figures["speech RTF@3"]["unit"] == "x real time" and figures["speech RTF@3"]["better"] == "higher"
    assert figures["speech latency p50@3"]["value"] == 2.0
    assert figures["speech WER@3"]["value"] == pytest.approx(100 * 3 / 18)


def test_a_failed_request_invalidates_and_gives_no_figures():
    clips = _clips(1)
    run = {"streams": 1, "repeats": 1, "wall_s": 1.0,
           "requests": [{"stream": 0, "clip": "c0", "audio_s": 2.0, "latency_s": 1.0, "text": None,
                         "error": "APIError: 400 bad audio"}]}
    figures, problems = speech.stream_figures("speech", run, clips)
    assert figures == {} and "c0 (stream 0) failed: APIError: 400 bad audio" in problems[0]


def test_run_streams_runs_the_streams_at_once():
    clips = _clips(2, seconds=1.0)

    def slow(clip):
        time.sleep(0.2)
        return clip.reference

    run = speech.run_streams(slow, clips, streams=4)
    assert len(run["requests"]) == 8 and {r["stream"] for r in run["requests"]} == {0, 1, 2, 3}
    assert 0.35 < run["wall_s"] < 0.8  # 2 requests of 0.2 s per stream, the 4 streams overlapping
    figures, problems = speech.stream_figures("speech", run, clips)
    assert problems == [] and figures["speech WER@4"]["value"] == 0.0
    assert figures["speech RTF@4"]["value"] == pytest.approx(8.0 / run["wall_s"])


# --- the pass, through the runner, with a fake engine -------------------------------------


@pytest.fixture
def fake_speech_engine(monkeypatch, tmp_path):
    monkeypatch.setitem(runner.PASS_MODULES, "faster-whisper", "tests.harness.fake_speech_pass")
    monkeypatch.setitem(runner.PASS_MODULES, "whispercpp", "tests.harness.fake_speech_pass")
    monkeypatch.setattr(runner, "resolve_arm_model", lambda arm: str(tmp_path))
    monkeypatch.setattr(runner, "EXIT_GRACE_S", 1.0)


def _fake_grid(tmp_path, **workload):
    from vllm_omni_edge_bench.harness import pass_speech

    def prepare(spec, arm):  # no whisper.cpp conversion: the fake engine reads no file
        return {**spec, "model_name": arm.model, "faster_whisper": {"compute_type": "int8"}, "whispercpp": None}

    return parse_grid(speech_grid(workloads=[{"speech": {"streams": [1, 2], **workload}}])), prepare, pass_speech


def test_pass_through_the_runner_gives_figures_evidence_and_memory(fake_speech_engine, tmp_path, monkeypatch):
    grid, prepare, pass_speech = _fake_grid(tmp_path)
    monkeypatch.setattr(pass_speech, "prepare_spec", prepare)
    summary = runner.run_grid(grid, "", tmp_path / "out", quiet_options())
    assert summary["status"] == "ok", summary
    fw = summary["arms"]["fw"]
    for name in ("speech RTF@1", "speech RTF@2", "speech latency p50@1", "speech WER@1", "speech WER@2",
                 "tree PSS steady"):
        assert name in fw, name
    assert fw["speech WER@1"]["median"] == pytest.approx(100 * 1 / 53)  # the fake mishears one word
    record = json.loads((tmp_path / "out" / "passes" / "01-fw.json").read_text())
    (worker,) = record["evidence"]["workers"]
    assert worker["role"] == "fake_speech" and worker["engine"] == "fake"
    runs = {r["streams"]: r for r in record["result"]["workloads"][0]["speech"]["runs"]}
    assert len(runs[2]["requests"]) == 10


def test_a_failing_request_makes_the_pass_invalid(fake_speech_engine, tmp_path, monkeypatch):
    grid, prepare, pass_speech = _fake_grid(tmp_path)
    monkeypatch.setattr(pass_speech, "prepare_spec", prepare)
    monkeypatch.setenv("FAKE_SPEECH_FAIL_CLIP", "garden")
    summary = runner.run_grid(grid, "", tmp_path / "out", quiet_options())
    assert summary["status"] == "invalid"
    record = json.loads((tmp_path / "out" / "passes" / "01-fw.json").read_text())
    assert any("garden (stream 0) failed: RuntimeError: cannot hear garden" in r for r in record["reasons"])


def test_the_report_renders_speech_figures(fake_speech_engine, tmp_path, monkeypatch):
    from vllm_omni_edge_bench.harness.report import write_report

    grid, prepare, pass_speech = _fake_grid(tmp_path)
    monkeypatch.setattr(pass_speech, "prepare_spec", prepare)
    runner.run_grid(grid, "", tmp_path / "out", quiet_options())
    text = write_report(tmp_path / "out").read_text()
    assert "speech RTF@2 (↑)" in text and "× real time" in text
    assert "## Speech" in text and "| fw (control) |" in text


# --- smoke runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("flags, says", [
    (["--passes", "1"], "passes"),                      # below the minimum without --smoke
    (["--smoke", "--passes", "3"], "--smoke takes --passes 1 or 2"),
])
def test_fewer_than_three_passes_only_as_a_smoke_run(flags, says, capsys):
    from vllm_omni_edge_bench.harness import cli

    assert cli.main(["run", str(GRID), "--check", *flags]) == cli.EXIT_BAD_GRID
    assert says in capsys.readouterr().err


def test_a_smoke_run_is_headed_so_in_the_report(fake_speech_engine, tmp_path, monkeypatch):
    from vllm_omni_edge_bench.harness.report import write_report

    grid, prepare, pass_speech = _fake_grid(tmp_path)
    monkeypatch.setattr(pass_speech, "prepare_spec", prepare)
    runner.run_grid(grid.model_copy(update={"passes": 1}), "", tmp_path / "out", quiet_options(),
                    overrides={"smoke": True, "passes": 1})
    assert "**Smoke run**" in write_report(tmp_path / "out").read_text()


def test_speech_figures_are_the_passes_figure_records():
    from vllm_omni_edge_bench.harness.pass_common import figure

    assert speech.figure(2.5, "s", "lower", "src") == figure(2.5, "s", "lower", "src")
