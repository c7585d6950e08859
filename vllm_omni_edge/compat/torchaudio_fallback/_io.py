"""``torchaudio.load`` / ``save`` / ``info`` on soundfile (libsndfile).

Tensors are ``[channels, time]`` (``channels_first=True``) like torchaudio;
soundfile's arrays are ``[time, channels]``, so we transpose at the boundary.
Every ``backend`` name is served by soundfile: decoding the same file with a
different library gives the same samples, so the choice is not honoured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

__all__ = ["AudioMetaData", "info", "list_audio_backends", "load", "save"]

_PREFIX = "torchaudio fallback: "
_BACKENDS = (None, "soundfile", "sox", "ffmpeg")

# Containers whose integer PCM torchaudio returns natively when normalize=False.
_WAV_LIKE = {"WAV", "WAVEX", "RF64", "W64"}
_NATIVE_INT = {"PCM_16": torch.int16, "PCM_24": torch.int32, "PCM_32": torch.int32, "PCM_U8": torch.uint8}

# torchaudio format names -> (libsndfile container, forced subtype or None)
_FORMATS = {
    "wav": ("WAV", None),
    "wave": ("WAV", None),
    "flac": ("FLAC", None),
    "ogg": ("OGG", "VORBIS"),
    "vorbis": ("OGG", "VORBIS"),
    "opus": ("OGG", "OPUS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "aiff": ("AIFF", None),
    "aif": ("AIFF", None),
    "au": ("AU", None),
    "w64": ("W64", None),
    "rf64": ("RF64", None),
    "caf": ("CAF", None),
}

# libsndfile subtype -> (torchaudio encoding, bits_per_sample)
_ENCODINGS = {
    "PCM_S8": ("PCM_S", 8),
    "PCM_16": ("PCM_S", 16),
    "PCM_24": ("PCM_S", 24),
    "PCM_32": ("PCM_S", 32),
    "PCM_U8": ("PCM_U", 8),
    "FLOAT": ("PCM_F", 32),
    "DOUBLE": ("PCM_F", 64),
    "ULAW": ("ULAW", 8),
    "ALAW": ("ALAW", 8),
    "VORBIS": ("VORBIS", 0),
    "OPUS": ("OPUS", 0),
    "MPEG_LAYER_III": ("MP3", 0),
}


@dataclass
class AudioMetaData:
    sample_rate: int
    num_frames: int
    num_channels: int
    bits_per_sample: int
    encoding: str


def list_audio_backends() -> list[str]:
    return ["soundfile"]


def _check_backend(backend: str | None) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"{_PREFIX}backend={backend!r} is not supported (soundfile serves {_BACKENDS[1:]})")


def _source(uri: Any) -> Any:
    if isinstance(uri, (str, os.PathLike)):
        return os.fspath(uri)
    if hasattr(uri, "read"):
        return uri
    raise TypeError(f"{_PREFIX}expected a path or a binary file-like object, got {type(uri).__name__}")


def _check_read_format(format: str | None) -> None:
    # libsndfile identifies the container from the header, so `format` is only
    # a hint we can drop, except for headerless data that needs more than it.
    if format is not None and format.lower() in ("raw", "pcm", "s16le", "f32le"):
        raise ValueError(f"{_PREFIX}format={format!r}: headerless audio is not supported")


def info(uri: Any, format: str | None = None, buffer_size: int = 4096, backend: str | None = None) -> AudioMetaData:
    """Header facts of an audio file, as torchaudio's ``AudioMetaData``."""
    import soundfile as sf

    _check_backend(backend)
    _check_read_format(format)
    meta = sf.info(_source(uri))
    encoding, bits = _ENCODINGS.get(meta.subtype, ("UNKNOWN", 0))
    if meta.format == "FLAC":
        encoding = "FLAC"
    return AudioMetaData(int(meta.samplerate), int(meta.frames), int(meta.channels), bits, encoding)


def load(
    uri: Any,
    frame_offset: int = 0,
    num_frames: int = -1,
    normalize: bool = True,
    channels_first: bool = True,
    format: str | None = None,
    buffer_size: int = 4096,
    backend: str | None = None,
) -> tuple[torch.Tensor, int]:
    """Decode audio to ``(waveform, sample_rate)``.

    ``normalize=True`` gives float32 in ``[-1, 1]``. ``normalize=False`` gives
    the native integer samples for integer-PCM WAV (int16; int32 for 24/32-bit,
    full scale; uint8 for 8-bit) and float32 for everything else, as torchaudio.
    """
    import soundfile as sf

    _check_backend(backend)
    _check_read_format(format)
    if frame_offset < 0:
        raise ValueError(f"{_PREFIX}frame_offset must be >= 0, got {frame_offset}")
    if num_frames == 0 or num_frames < -1:
        raise ValueError(f"{_PREFIX}num_frames must be -1 (all) or positive, got {num_frames}")

    with sf.SoundFile(_source(uri)) as f:
        native = None if normalize or f.format not in _WAV_LIKE else _NATIVE_INT.get(f.subtype)
        if frame_offset:
            if f.seekable():
                f.seek(min(frame_offset, f.frames))
            else:
                f.read(frame_offset, dtype="float32", always_2d=True)
        read_dtype = {None: "float32", torch.int16: "int16", torch.int32: "int32", torch.uint8: "int16"}[native]
        data = f.read(num_frames, dtype=read_dtype, always_2d=True)
        sample_rate = int(f.samplerate)

    if native is torch.uint8:
        # libsndfile widens unsigned 8-bit to signed 16-bit (x - 128) << 8; undo it.
        data = ((data.astype(np.int32) >> 8) + 128).astype(np.uint8)
    waveform = torch.from_numpy(np.ascontiguousarray(data.T if channels_first else data))
    return waveform, sample_rate


def _container(uri: Any, format: str | None) -> tuple[str, str | None]:
    import soundfile as sf

    if format is None:
        if not isinstance(uri, str):
            raise ValueError(f"{_PREFIX}`format` is required when saving to a file-like object")
        ext = os.path.splitext(uri)[1].lstrip(".").lower()
        if not ext:
            raise ValueError(f"{_PREFIX}cannot infer the format of {uri!r}; pass `format`")
        format = ext
    key = format.lower()
    if key in _FORMATS:
        return _FORMATS[key]
    if key.upper() in sf.available_formats():
        return key.upper(), None
    raise ValueError(f"{_PREFIX}format={format!r} is not supported")


def _subtype(container: str, forced: str | None, dtype: torch.dtype, encoding: str | None, bits: int | None) -> str:
    if forced is not None:
        if encoding is not None or bits is not None:
            raise ValueError(f"{_PREFIX}encoding/bits_per_sample cannot be set for {container}/{forced}")
        return forced
    if encoding is None and bits is None:
        if container == "FLAC":  # FLAC has no float samples; torchaudio writes 24-bit
            return {torch.int16: "PCM_16", torch.uint8: "PCM_S8", torch.int8: "PCM_S8"}.get(dtype, "PCM_24")
        return {
            torch.float64: "DOUBLE",
            torch.int32: "PCM_32",
            torch.int16: "PCM_16",
            torch.uint8: "PCM_U8",
            torch.int8: "PCM_S8",
        }.get(dtype, "FLOAT")
    if encoding is None:  # bits only: integer for ints, float at 32/64 bits for floats
        table = {8: "PCM_U8", 16: "PCM_16", 24: "PCM_24", 32: "FLOAT" if dtype.is_floating_point else "PCM_32"}
        table[64] = "DOUBLE"
        if bits not in table:
            raise ValueError(f"{_PREFIX}bits_per_sample={bits!r} is not supported")
        return table[bits]
    if bits is None:
        bits = {"PCM_F": 64 if dtype == torch.float64 else 32, "PCM_U": 8, "ULAW": 8, "ALAW": 8}.get(encoding)
        if bits is None:  # PCM_S
            bits = {torch.int16: 16, torch.uint8: 8, torch.int8: 8}.get(dtype, 32 if container != "FLAC" else 24)
    for subtype, (enc, b) in _ENCODINGS.items():
        if enc == encoding and b == bits:
            return subtype
    raise ValueError(f"{_PREFIX}encoding={encoding!r} with bits_per_sample={bits!r} is not supported")


def save(
    uri: str | os.PathLike | BinaryIO,
    src: torch.Tensor,
    sample_rate: int,
    channels_first: bool = True,
    format: str | None = None,
    encoding: str | None = None,
    bits_per_sample: int | None = None,
    buffer_size: int = 4096,
    backend: str | None = None,
    compression: Any = None,
) -> None:
    """Encode ``src`` (``[channels, time]``, or ``[time]`` for mono) to a file or file-like object.

    The sample encoding follows the tensor dtype unless ``encoding`` /
    ``bits_per_sample`` say otherwise (float32 -> 32-bit float WAV, int16 ->
    16-bit PCM, ...). Float data is clipped to ``[-1, 1]`` before integer or
    lossy encoding, so out-of-range samples saturate instead of wrapping.
    """
    import soundfile as sf

    _check_backend(backend)
    if compression is not None:
        raise ValueError(f"{_PREFIX}compression={compression!r} is not supported")
    uri = _source(uri)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{_PREFIX}src must be a torch.Tensor, got {type(src).__name__}")
    if src.dim() not in (1, 2):
        raise ValueError(f"{_PREFIX}expected a 1D or 2D tensor, got shape {tuple(src.shape)}")
    container, forced = _container(uri, format)
    subtype = _subtype(container, forced, src.dtype, encoding, bits_per_sample)
    if not sf.check_format(container, subtype):
        raise ValueError(f"{_PREFIX}{container} cannot hold {subtype} samples")

    x = src.detach().cpu()
    if x.dim() == 2 and channels_first:
        x = x.transpose(0, 1)
    if x.is_floating_point():
        data = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).numpy()
        if subtype not in ("FLOAT", "DOUBLE"):
            data = np.clip(data, -1.0, 1.0)
    elif x.dtype in (torch.int16, torch.int32):
        data = x.numpy()
    elif x.dtype == torch.uint8:
        data = ((x.numpy().astype(np.int16) - 128) << 8).astype(np.int16)
    elif x.dtype == torch.int8:
        data = (x.numpy().astype(np.int16) << 8).astype(np.int16)
    else:
        raise ValueError(f"{_PREFIX}cannot save a {x.dtype} tensor")
    sf.write(uri, np.ascontiguousarray(data), int(sample_rate), subtype=subtype, format=container)
