"""The speech workload: the committed fixtures transcribed at 1 and at N concurrent streams.

Every speech arm (the server, faster-whisper, whisper.cpp) runs this same driver with its own
``transcribe(audio) -> text`` callable, so RTF, latency and WER mean the same for all of them:

- **Clips.** ``tests/fixtures/speech/<id>.wav`` (16 kHz mono, espeak-ng; ``make.sh``), in
  ``sentences.txt`` order; each reference is its line of ``sentences.txt``.
- **Streams.** For each entry N of ``streams``, N threads start together; thread k transcribes
  the clip list ``repeats`` times, starting at clip k (so N streams do not ask for the same clip
  at the same instant). A request is one clip, sent whole, answered whole.
- **RTF** (``× real time``): audio seconds transcribed over the wall seconds from the common
  start to the last answer. Higher is better; 1.0 is as fast as the speech was spoken.
- **Latency p50**: the median over requests of request start to its answer.
- **WER**: jiwer's corpus WER (errors over all reference words) of :func:`normalise`-d
  references and transcripts, over every request at that stream count.

Normalisation (:func:`normalise`), applied to both sides, is exactly:

1. Unicode NFKC, then lower case.
2. Every character that is not a letter, a digit or whitespace becomes a space
   (punctuation, apostrophes and hyphens included: "don't" -> "don t", "well-known" -> "well known").
3. Runs of whitespace become one space; leading and trailing space is dropped.

No number, spelling or contraction rewriting (the sentences avoid digits and contractions).
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import pass_events

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FIXTURES = "tests/fixtures/speech"
SAMPLE_RATE = 16000
RTF_SOURCE = ("wall clock: audio seconds of every request / seconds from the streams' common start "
              "to the last answer")
LATENCY_SOURCE = "wall clock: median over requests of request start to its whole answer"
WER_SOURCE = "jiwer corpus WER of normalised references and transcripts (vllm_omni_edge_bench/harness/speech.py)"


def figure(value: float, unit: str, better: str, source: str) -> dict[str, Any]:
    """A figure record, as pass_common.figure makes it (not imported: grid.py imports this module)."""
    return {"value": value, "unit": unit, "better": better, "source": source}


class SpeechFixtureError(ValueError):
    """The fixture directory is missing, or a clip is not 16 kHz mono audio."""


@dataclass(frozen=True)
class Clip:
    key: str
    path: Path
    reference: str
    duration_s: float


def fixtures_dir(path: str | Path = DEFAULT_FIXTURES) -> Path:
    """A fixture directory; a relative path is relative to the checkout."""
    path = Path(path)
    return path if path.is_absolute() else PROJECT_ROOT / path


def load_clips(directory: str | Path = DEFAULT_FIXTURES) -> list[Clip]:
    """The clips ``sentences.txt`` lists (``id<TAB>sentence``), each checked as 16 kHz mono."""
    import soundfile as sf

    root = fixtures_dir(directory)
    listing = root / "sentences.txt"
    if not listing.is_file():
        raise SpeechFixtureError(f"{listing} does not exist (a speech fixture directory holds sentences.txt)")
    clips = []
    for n, line in enumerate(listing.read_text(encoding="utf-8").splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        if "\t" not in line:
            raise SpeechFixtureError(f"{listing}:{n}: expected 'id<TAB>sentence', got {line!r}")
        key, text = line.split("\t", 1)
        path = root / f"{key}.wav"
        if not path.is_file():
            raise SpeechFixtureError(f"{listing}:{n}: {path} does not exist")
        info = sf.info(str(path))
        if info.samplerate != SAMPLE_RATE or info.channels != 1:
            raise SpeechFixtureError(f"{path}: {info.samplerate} Hz, {info.channels} channels; "
                                     f"the speech workload takes {SAMPLE_RATE} Hz mono")
        clips.append(Clip(key, path, text, info.frames / info.samplerate))
    if not clips:
        raise SpeechFixtureError(f"{listing} lists no clip")
    return clips


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return re.sub(r"\s+", " ", text).strip()


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER (errors over all reference words) of the normalised texts."""
    import jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    if not references:
        raise ValueError("no transcript to score")
    return jiwer.wer([normalise(r) for r in references], [normalise(h) for h in hypotheses])


def stream_order(n_clips: int, stream: int, repeats: int) -> list[int]:
    """Clip indices stream ``stream`` asks for, in order: the list ``repeats`` times, from clip ``stream``."""
    return [(stream + i) % n_clips for i in range(n_clips * repeats)]


def rtf(audio_s: float, wall_s: float) -> float:
    if wall_s <= 0:
        raise ValueError(f"wall time {wall_s} s: the requests took no time")
    return audio_s / wall_s


def run_streams(transcribe: Callable[[Clip], str], clips: list[Clip], streams: int, repeats: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """N threads transcribing at once; returns the requests and the wall time. A request that
    raises is recorded with its error, not retried."""
    requests: list[dict[str, Any]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(streams + 1)

    def worker(stream: int) -> None:
        barrier.wait()
        for index in stream_order(len(clips), stream, repeats):
            clip = clips[index]
            start = clock()
            text, error = None, None
            try:
                text = transcribe(clip)
            except Exception as exc:  # counted: a pass with a failed request is invalid
                error = f"{type(exc).__name__}: {exc}"[:500]
            record = {"stream": stream, "clip": clip.key, "audio_s": clip.duration_s, "start": start,
                      "end": clock(), "text": text, "error": error}
            with lock:
                requests.append(record)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = clock()
    for t in threads:
        t.join()
    t1 = max((r["end"] for r in requests), default=clock())
    for r in requests:
        r["latency_s"] = r["end"] - r["start"]
        r["start"], r["end"] = r["start"] - t0, r["end"] - t0
    return {"streams": streams, "repeats": repeats, "wall_s": t1 - t0, "requests": requests}


def stream_figures(label: str, run: dict[str, Any], clips: list[Clip]) -> tuple[dict[str, Any], list[str]]:
    """RTF, latency p50 and WER of one stream count; and what makes the pass invalid."""
    n, requests = run["streams"], run["requests"]
    refs = {c.key: c.reference for c in clips}
    problems = [f"{label}@{n}: {r['clip']} (stream {r['stream']}) failed: {r['error']}"
                for r in requests if r["error"] is not None]
    expected = len(clips) * run["repeats"] * n
    if len(requests) != expected:
        problems.append(f"{label}@{n}: {len(requests)} requests answered, {expected} sent")
    figures: dict[str, Any] = {}
    done = [r for r in requests if r["error"] is None]
    if problems or not done:
        return figures, problems or [f"{label}@{n}: no request answered"]
    audio_s = sum(r["audio_s"] for r in done)
    figures[f"{label} RTF@{n}"] = figure(rtf(audio_s, run["wall_s"]), "x real time", "higher", RTF_SOURCE)
    figures[f"{label} latency p50@{n}"] = figure(statistics.median(r["latency_s"] for r in done), "s", "lower",
                                                 LATENCY_SOURCE)
    score = wer([refs[r["clip"]] for r in done], [r["text"] for r in done])
    figures[f"{label} WER@{n}"] = figure(100.0 * score, "%", "lower", WER_SOURCE)
    return figures, problems


def run_workload(workload: dict[str, Any], transcribe: Callable[[Clip], str]) -> tuple[dict[str, Any], list[str]]:
    """The whole speech workload for one arm: warm-up, then each stream count in order."""
    label = workload["label"]
    clips = load_clips(workload.get("fixtures", DEFAULT_FIXTURES))
    problems: list[str] = []
    warmup = None
    if workload.get("warmup", True):
        start = time.perf_counter()
        text = transcribe(clips[0])  # an error here is a crash: nothing after it would measure
        warmup = {"clip": clips[0].key, "seconds": time.perf_counter() - start, "text": text}
    figures: dict[str, Any] = {}
    runs = []
    for n in workload["streams"]:
        with pass_events.timed_request():
            run = run_streams(transcribe, clips, n, workload.get("repeats", 1))
        got, bad = stream_figures(label, run, clips)
        figures.update(got)
        problems += bad
        runs.append(run)
    result = {"kind": workload["kind"], "label": label, "params": workload, "figures": figures, "requests": [],
              "speech": {"warmup": warmup, "clips": [{"key": c.key, "audio_s": c.duration_s, "reference": c.reference}
                                                     for c in clips], "runs": runs}}
    return result, problems
