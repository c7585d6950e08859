"""The speech fixtures (tests/fixtures/speech) and how a transcript is scored.

Scoring: word error rate from jiwer over the normalised reference and hypothesis. The
normalisation, applied to both sides, is exactly:

1. Unicode NFKC, then lower case.
2. Every character that is not a letter, a digit or whitespace becomes a space
   (punctuation, apostrophes and hyphens included: "don't" -> "don t", "well-known" -> "well known").
3. Runs of whitespace become one space; leading and trailing space is dropped.

No number, spelling or contraction rewriting (the sentences avoid digits and contractions).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

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


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return re.sub(r"\s+", " ", text).strip()


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER (errors over all reference words) of the normalised texts."""
    import jiwer

    return jiwer.wer([normalise(r) for r in references], [normalise(h) for h in hypotheses])
