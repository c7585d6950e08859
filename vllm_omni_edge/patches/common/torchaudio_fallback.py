"""Serve a soundfile/soxr implementation of torchaudio when the real one cannot load.

What: appends ``compat/torchaudio_fallback/finder.py``'s finder to the end of
``sys.meta_path``; ``import torchaudio`` (and ``torchaudio.functional`` /
``torchaudio.transforms``) then resolves to our package only if no other
finder locates a real torchaudio.
Why: PyPI's torchaudio 2.11.1 does not load against torch 2.13.0+cpu (ABI
mismatch), so it is uninstalled; vLLM-Omni imports it on the serving path
(``entrypoints/openai/audio_utils_mixin.py``, ``utils/audio.py``) and in model
code (resample, load/save, mel filterbanks, phase-vocoder speed change).
Verified by: tests/test_torchaudio_fallback.py (signal-level checks of every
function, the finder in a clean subprocess, and importing and running
``audio_utils_mixin``'s resample/speed path on a sine).
Remove when: a torchaudio wheel built for torch 2.13 CPU loads from PyPI.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="torchaudio_fallback",
    kind=Kind.FIX,
    target="sys.meta_path (module name 'torchaudio')",
    process=Process.WORKER,
    why="PyPI's torchaudio 2.11.1 fails to load with torch 2.13.0+cpu (ABI mismatch), "
    "but vLLM-Omni imports torchaudio on its serving path and in model code.",
    verified_by="tests/test_torchaudio_fallback.py: signal checks (resample pitch/length, "
    "WAV round-trip, mel filterbank vs an independent formula, STFT/iSTFT, time-stretch), "
    "the finder in a clean subprocess, and audio_utils_mixin's resample/speed path.",
    remove_when="a torchaudio wheel for torch 2.13 CPU loads from PyPI.",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)


def apply() -> str:
    from vllm_omni_edge.compat.torchaudio_fallback.finder import install

    return install()
