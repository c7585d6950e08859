"""One pass of one in-process speech baseline (faster-whisper or whisper.cpp), in a fresh process.

    python -m vllm_omni_edge_bench.harness.pass_speech --spec spec.json --out result.json

The pass loads the engine, transcribes the first clip once (its answer is the pass's
``first_token`` event: load is over), then runs the speech workload (speech.py) with the
engine's ``transcribe``. Audio is decoded to float32 with soundfile before any clock starts;
both engines take that array as it is (16 kHz mono).

Engines, as their users run them:
- ``faster-whisper``: one ``WhisperModel`` on the model's CTranslate2 directory with
  ``cpu_threads`` and ``num_workers``; N streams are N Python threads calling ``transcribe`` on
  it, the concurrency faster-whisper documents (``num_workers`` transcriptions run at once,
  sharing the weights).
- ``whispercpp``: pywhispercpp's ``Model`` on a whisper.cpp file converted from the same
  weights before the pass (baselines/whisper_ggml.py). One whisper.cpp context runs one
  transcription at a time, so N streams queue on a lock, as whisper.cpp's own server does.

Decoding is the same for all speech arms: the workload's language, greedy (temperature 0, no
temperature fallback), no timestamps. The pass imports no torch; it writes the engine's evidence
(versions, compute type, threads, model file, CPU features) as ``worker-<pid>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.grid import EVIDENCE_ENV
from vllm_omni_edge_bench.harness.pass_common import pass_main, run_workloads, start_up_figures

FIRST_RESULT_SOURCE = "wall clock: engine construction (model load)"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _file_bytes(path: Path) -> int:
    path = Path(path)
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else path.stat().st_size


# ---------------------------------------------------------------------------
# In the harness process


def prepare_spec(spec: dict[str, Any], arm) -> dict[str, Any]:
    """The arm's settings; for whisper.cpp the converted file, written (once, cached) here so the
    conversion is neither timed nor in the pass's memory ledger."""
    out = {**spec, "model_name": arm.model}
    if arm.engine == "faster-whisper":
        out["faster_whisper"] = arm.faster_whisper.model_dump()
    elif arm.engine == "whispercpp":
        from vllm_omni_edge_bench.baselines.whisper_ggml import F16, F32, ensure_ggml

        settings = arm.whispercpp.model_dump()
        ggml = ensure_ggml(Path(spec["model"]), ftype=F16 if settings["ftype"] == "f16" else F32)
        out["whispercpp"] = {**settings, "ggml_path": str(ggml), "converted_from": spec["model"]}
    return out


# ---------------------------------------------------------------------------
# In the pass process


class FasterWhisperEngine:
    role = "faster_whisper"

    def __init__(self, spec: dict[str, Any]):
        from faster_whisper import WhisperModel

        self.settings = spec["faster_whisper"]
        self.language = _language(spec)
        self.path = spec["model"]
        self.model = WhisperModel(self.path, device="cpu", compute_type=self.settings["compute_type"],
                                  cpu_threads=self.settings["cpu_threads"],
                                  num_workers=self.settings["num_workers"], local_files_only=True)

    def transcribe(self, audio) -> str:
        segments, _info = self.model.transcribe(
            audio, language=self.language, beam_size=self.settings["beam_size"], temperature=0.0,
            without_timestamps=True, vad_filter=False, condition_on_previous_text=False)
        return "".join(segment.text for segment in segments).strip()  # the generator does the work

    def evidence(self) -> dict[str, Any]:
        import ctranslate2

        inner = self.model.model
        return {
            "engine": "faster-whisper", "faster_whisper": _version("faster-whisper"),
            "ctranslate2": ctranslate2.__version__, "model_path": self.path, "model_file_bytes": _file_bytes(self.path),
            # CTranslate2's effective type: "int8" on a CPU is int8 weights with float32 elsewhere, int8_float32.
            "compute_type": inner.compute_type, "compute_type_requested": self.settings["compute_type"],
            "device": inner.device, "num_workers": inner.num_workers,
            "cpu_threads": self.settings["cpu_threads"], "beam_size": self.settings["beam_size"],
            "supported_compute_types": sorted(ctranslate2.get_supported_compute_types("cpu")),
            "concurrency": f"one WhisperModel, num_workers={inner.num_workers}; streams are threads calling it",
            "decoding": {"language": self.language, "temperature": 0.0, "without_timestamps": True,
                         "vad_filter": False, "condition_on_previous_text": False},
        }


class WhisperCppEngine:
    role = "whispercpp"

    def __init__(self, spec: dict[str, Any], log_path: Path):
        from pywhispercpp.model import Model

        self.settings = spec["whispercpp"]
        self.language = _language(spec)
        self.path = self.settings["ggml_path"]
        self.lock = threading.Lock()
        self.model = Model(self.path, redirect_whispercpp_logs_to=str(log_path), n_threads=self.settings["n_threads"],
                           language=self.language, no_timestamps=True, temperature=0.0, temperature_inc=0.0,
                           print_progress=False, print_realtime=False)
        # A file whisper.cpp refuses still gives pywhispercpp a context (a null one); its log says why.
        log = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
        refused = [line for line in log.splitlines() if "ERROR" in line or "failed to load" in line]
        if refused:
            raise RuntimeError(f"whisper.cpp did not load {self.path}: {' / '.join(refused[-2:])}")

    def transcribe(self, audio) -> str:
        with self.lock:  # one context: one transcription at a time
            segments = self.model.transcribe(audio)
        return " ".join(segment.text.strip() for segment in segments).strip()

    def evidence(self) -> dict[str, Any]:
        import _pywhispercpp as pw

        return {
            "engine": "whispercpp", "pywhispercpp": _version("pywhispercpp"), "model_path": self.path,
            "model_file_bytes": _file_bytes(Path(self.path)), "ftype": self.settings["ftype"],
            "converted_from": self.settings.get("converted_from"),
            "n_threads": self.settings["n_threads"], "system_info": pw.whisper_print_system_info(),
            "concurrency": "one whisper.cpp context; streams queue on a lock",
            "decoding": {"language": self.language, "strategy": "greedy", "temperature": 0.0,
                         "temperature_inc": 0.0, "no_timestamps": True},
        }


def _language(spec: dict[str, Any]) -> str:
    languages = {w.get("language", "en") for w in spec["workloads"] if w["kind"] == "speech"}
    if len(languages) > 1:
        raise ValueError(f"speech workloads of one grid ask for different languages: {sorted(languages)}")
    return languages.pop() if languages else "en"


def _write_evidence(role: str, evidence: dict[str, Any]) -> None:
    directory = os.environ.get(EVIDENCE_ENV)
    if not directory:
        return
    from vllm_omni_edge.atomic import atomic_write_bytes

    pid, base = os.getpid(), Path(directory)
    atomic_write_bytes(base / f"process-{pid}.json",
                       json.dumps({"pid": pid, "ppid": os.getppid(), "role": role, "patches": []}).encode())
    worker = {"pid": pid, "ppid": os.getppid(), "role": role, **evidence}
    atomic_write_bytes(base / f"worker-{pid}.json", json.dumps(worker, indent=2, default=str).encode())


def make_engine(spec: dict[str, Any], pass_dir: Path):
    if spec["engine"] == "faster-whisper":
        return FasterWhisperEngine(spec)
    if spec["engine"] == "whispercpp":
        return WhisperCppEngine(spec, pass_dir / "whispercpp.log")
    raise ValueError(f"engine {spec['engine']!r} is not an in-process speech engine")


def run_pass(spec: dict[str, Any], engine_factory=make_engine) -> dict[str, Any]:
    import psutil
    import soundfile as sf

    from vllm_omni_edge_bench.harness import speech

    events = spec["events_path"]
    pass_dir = Path(events).parent
    pass_events.emit(events, pass_events.STARTED)
    process_start = psutil.Process().create_time()
    audio: dict[str, Any] = {}
    for workload in spec["workloads"]:
        if workload["kind"] == "speech":
            for clip in speech.load_clips(workload["fixtures"]):
                audio[str(clip.path)] = sf.read(str(clip.path), dtype="float32")[0]

    start = time.perf_counter()
    engine = engine_factory(spec, pass_dir)
    load_s = time.perf_counter() - start
    pass_events.emit(events, pass_events.ENGINE_READY)
    evidence = engine.evidence()
    _write_evidence(engine.role, evidence)

    first_clip = next(iter(audio), None)
    first_start = time.perf_counter()
    first_text = engine.transcribe(audio[first_clip]) if first_clip else None
    first_s = time.perf_counter() - first_start
    first_t = pass_events.emit(events, pass_events.FIRST_TOKEN)
    timings = {"process_start_to_first_result_s": first_t - process_start, "engine_constructor_s": load_s,
               "first_request_s": first_s}

    problems: list[str] = []

    def run_one(workload: dict[str, Any]) -> dict[str, Any]:
        if workload["kind"] == "cold_start":
            return {"kind": "cold_start", "label": workload["label"], "params": workload, "figures": {}, "requests": []}
        if workload["kind"] != "speech":
            raise NotImplementedError(f"workload {workload['kind']!r} is not implemented for {spec['engine']} passes")
        result, bad = speech.run_workload(workload, lambda clip: engine.transcribe(audio[str(clip.path)]))
        problems.extend(bad)
        return result

    start_up = start_up_figures({"process_start_to_first_token_s": timings["process_start_to_first_result_s"]},
                                "load", load_s, FIRST_RESULT_SOURCE)
    workloads = run_workloads(spec["workloads"], run_one, start_up)
    pass_events.emit(events, pass_events.WORKLOADS_DONE)
    return {
        "engine": spec["engine"],
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "pid": os.getpid(),
        "model": spec["model"],
        "settings": spec.get("faster_whisper") or spec.get("whispercpp"),
        "evidence": evidence,
        "versions": {"python": platform.python_version(),
                     **{k: v for k, v in evidence.items() if k in ("faster_whisper", "ctranslate2", "pywhispercpp")}},
        "timings": timings,
        "first_request": {"seconds": first_s, "text": first_text},
        "workloads": workloads,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    return pass_main(run_pass, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
