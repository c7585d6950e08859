"""A working subset of torchaudio on soundfile + soxr + torch, for when torchaudio cannot load.

Why: PyPI's torchaudio 2.11.1 is built against an older torch ABI and fails to
import with torch 2.13.0+cpu, yet vLLM-Omni imports ``torchaudio`` on its
serving path. ``finder.install()`` serves this package as ``torchaudio`` (and
``torchaudio.functional`` / ``torchaudio.transforms``) only when no real
torchaudio is importable.

Implemented (torchaudio signatures and shapes):

- ``load``, ``save``, ``info``, ``list_audio_backends`` (libsndfile formats);
- ``functional``: ``resample`` (soxr), ``melscale_fbanks``, ``spectrogram``,
  ``inverse_spectrogram``, ``phase_vocoder``, ``amplitude_to_DB``,
  ``DB_to_amplitude``;
- ``transforms``: ``Resample``, ``Spectrogram``, ``InverseSpectrogram``,
  ``MelScale``, ``MelSpectrogram``, ``TimeStretch``, ``AmplitudeToDB``.

Not provided: ``torchaudio.compliance.kaldi``, ``torchaudio.models``,
``torchaudio.pipelines``, streaming I/O, and any other function; importing
those still fails with ``ModuleNotFoundError`` / ``AttributeError``.
Resampling is band-limited but not bit-identical to torchaudio's sinc kernel.
"""

from __future__ import annotations

from . import functional, transforms
from ._io import AudioMetaData, info, list_audio_backends, load, save

# The torchaudio API level mirrored, tagged so nobody mistakes it for the real wheel.
__version__ = "2.11.1+edgefallback"

# Lets the finder (and anyone else) tell this module from a real torchaudio.
__vllm_omni_edge_fallback__ = True

__all__ = [
    "AudioMetaData",
    "functional",
    "info",
    "list_audio_backends",
    "load",
    "save",
    "transforms",
]
