"""The speech fixtures (tests/fixtures/speech) and how a transcript is scored.

Scoring is the harness's (vllm_omni_edge_bench/harness/speech.py), so a test and a grid score a
transcript the same way: word error rate from jiwer over the normalised reference and
hypothesis. The normalisation, applied to both sides, is exactly:

1. Unicode NFKC, then lower case.
2. Every character that is not a letter, a digit or whitespace becomes a space
   (punctuation, apostrophes and hyphens included: "don't" -> "don t", "well-known" -> "well known").
3. Runs of whitespace become one space; leading and trailing space is dropped.

No number, spelling or contraction rewriting (the sentences avoid digits and contractions).
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_edge_bench.harness.speech import normalise, wer  # noqa: F401  (the one scoring)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "speech"


def sentences() -> dict[str, str]:
    """Fixture id -> the sentence its WAV speaks (tests/fixtures/speech/sentences.txt)."""
    out = {}
    for line in (FIXTURES / "sentences.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            key, text = line.split("\t", 1)
            out[key] = text
    return out


def wav(key: str) -> Path:
    return FIXTURES / f"{key}.wav"
