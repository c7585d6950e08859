"""``torchaudio.functional`` subset on torch + soxr (see the package docstring).

Everything here follows torchaudio's signatures and tensor conventions
(time on the last axis, any number of leading batch dims); the maths is
written out from the definitions, not copied from torchaudio.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

__all__ = [
    "DB_to_amplitude",
    "amplitude_to_DB",
    "inverse_spectrogram",
    "melscale_fbanks",
    "phase_vocoder",
    "resample",
    "spectrogram",
]

_PREFIX = "torchaudio fallback: "

# soxr's "HQ" is a 20-bit (~120 dB stop-band) linear-phase filter: at least as
# clean as torchaudio's 6-zero-crossing windowed sinc, and one-shot soxr
# compensates the filter delay, so samples stay time-aligned like torchaudio's.
_SOXR_QUALITY = "HQ"
_SOXR_MAX_CHANNELS = 65536  # python-soxr's per-call channel limit


# --------------------------------------------------------------------------- resample


def _check_rate(name: str, value) -> int:
    # torchaudio only accepts integral rates (it builds a polyphase kernel from
    # their gcd); keep that contract so callers fail here rather than on a real
    # torchaudio later.
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{_PREFIX}{name}={value!r} must be an integer sample rate") from None
    if as_int != value or as_int <= 0:
        raise ValueError(f"{_PREFIX}{name}={value!r} must be a positive integer sample rate")
    return as_int


def _check_resample_options(resampling_method: str, lowpass_filter_width: int, rolloff: float, beta) -> None:
    # The options below shape torchaudio's own windowed-sinc kernel. soxr has
    # its own (sharper) filter, so the filter width is a quality knob we may
    # ignore; a different method or cut-off would change the result, so refuse.
    if resampling_method not in ("sinc_interp_hann", "sinc_interpolation"):
        raise ValueError(f"{_PREFIX}resampling_method={resampling_method!r} is not supported")
    if beta is not None:
        raise ValueError(f"{_PREFIX}beta={beta!r} is not supported (only the default Hann-window sinc)")
    if not (isinstance(lowpass_filter_width, int) and lowpass_filter_width > 0):
        raise ValueError(f"{_PREFIX}lowpass_filter_width={lowpass_filter_width!r} must be a positive int")
    if not math.isclose(float(rolloff), 0.99, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"{_PREFIX}rolloff={rolloff!r} is not supported (soxr sets its own cut-off; only 0.99)")


def _soxr_resample_2d(rows: np.ndarray, orig: int, new: int) -> np.ndarray:
    """Resample each row of a C-contiguous ``[B, T]`` array; returns ``[B, T']``."""
    import soxr

    out = []
    for start in range(0, rows.shape[0], _SOXR_MAX_CHANNELS):
        block = rows[start : start + _SOXR_MAX_CHANNELS]
        # ``block.T`` is a channel-split ``[T, B]`` view, which soxr reads without a copy.
        out.append(np.asarray(soxr.resample(block.T, orig, new, _SOXR_QUALITY)).T)
    return np.concatenate(out, axis=0) if len(out) > 1 else out[0]


def resample(
    waveform: torch.Tensor,
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    resampling_method: str = "sinc_interp_hann",
    beta: float | None = None,
) -> torch.Tensor:
    """Band-limited resampling of ``[..., time]`` along the last axis with soxr.

    Output length is ``ceil(time * new_freq / orig_freq)`` and dtype, device and
    leading dims are preserved, as in torchaudio. The samples are not
    bit-identical to torchaudio's windowed-sinc interpolation: soxr uses its own
    linear-phase filter ("HQ"), which differs by a tiny amount near the
    cut-off and at the signal edges. Not differentiable (runs on numpy).
    """
    orig = _check_rate("orig_freq", orig_freq)
    new = _check_rate("new_freq", new_freq)
    _check_resample_options(resampling_method, lowpass_filter_width, rolloff, beta)
    if not isinstance(waveform, torch.Tensor):
        raise TypeError(f"{_PREFIX}waveform must be a torch.Tensor, got {type(waveform).__name__}")
    if not waveform.is_floating_point():
        raise TypeError(f"Expected floating point type for waveform tensor, but received {waveform.dtype}.")
    if orig == new:
        return waveform
    if waveform.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{_PREFIX}resample is not differentiable (soxr runs on numpy); detach the input")

    gcd = math.gcd(orig, new)
    orig, new = orig // gcd, new // gcd
    if waveform.dim() == 0:
        raise ValueError(f"{_PREFIX}waveform must have a time axis, got a 0-d tensor")
    shape = waveform.shape
    length = shape[-1]
    target_length = -(-new * length // orig)  # ceil, as torchaudio sizes its output

    work_dtype = waveform.dtype if waveform.dtype in (torch.float32, torch.float64) else torch.float32
    rows = waveform.detach().to("cpu", work_dtype).reshape(math.prod(shape[:-1]), length)
    if rows.shape[0] == 0 or length == 0:
        out = torch.zeros(rows.shape[0], target_length, dtype=work_dtype)
    else:
        data = _soxr_resample_2d(np.ascontiguousarray(rows.numpy()), orig, new)
        # soxr rounds the output length; pin it to torchaudio's ceil().
        if data.shape[1] > target_length:
            data = data[:, :target_length]
        elif data.shape[1] < target_length:
            data = np.pad(data, ((0, 0), (0, target_length - data.shape[1])))
        out = torch.from_numpy(np.ascontiguousarray(data))
    out = out.reshape(*shape[:-1], target_length)
    return out.to(device=waveform.device, dtype=waveform.dtype)


# --------------------------------------------------------------------------- mel filters


def _hz_to_mel(freq: np.ndarray, mel_scale: str) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    if mel_scale == "htk":
        return 2595.0 * np.log10(1.0 + freq / 700.0)
    # Slaney (Auditory Toolbox): linear below 1 kHz (66.67 Hz per mel), then log
    # with 27 mels per factor 6.4 in frequency.
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    with np.errstate(divide="ignore"):
        log_part = min_log_mel + np.log(np.maximum(freq, 1e-10) / min_log_hz) / logstep
    return np.where(freq >= min_log_hz, log_part, freq / f_sp)


def _mel_to_hz(mels: np.ndarray, mel_scale: str) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    if mel_scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(mels >= min_log_mel, min_log_hz * np.exp(logstep * (mels - min_log_mel)), f_sp * mels)


def melscale_fbanks(
    n_freqs: int,
    f_min: float,
    f_max: float,
    n_mels: int,
    sample_rate: int,
    norm: str | None = None,
    mel_scale: str = "htk",
) -> torch.Tensor:
    """Triangular mel filterbank, shape ``[n_freqs, n_mels]`` (float32).

    FFT bin ``k`` sits at ``k * (sample_rate // 2) / (n_freqs - 1)`` Hz. Filter
    ``m`` rises linearly from mel point ``m`` to ``m+1`` and falls to ``m+2``,
    with the ``n_mels + 2`` points evenly spaced on the chosen mel scale between
    ``f_min`` and ``f_max``. ``norm="slaney"`` scales each triangle by
    ``2 / (f[m+2] - f[m])`` so its area is constant (librosa's default).
    Computed in float64 and rounded once to float32.
    """
    if norm not in (None, "slaney"):
        raise ValueError(f'{_PREFIX}norm must be one of None or "slaney", got {norm!r}')
    if mel_scale not in ("htk", "slaney"):
        raise ValueError(f'{_PREFIX}mel_scale should be one of "htk" or "slaney", got {mel_scale!r}')

    all_freqs = np.linspace(0.0, float(sample_rate // 2), int(n_freqs))
    mel_pts = np.linspace(_hz_to_mel(f_min, mel_scale), _hz_to_mel(f_max, mel_scale), int(n_mels) + 2)
    f_pts = _mel_to_hz(mel_pts, mel_scale)  # [n_mels + 2]

    lower, centre, upper = f_pts[:-2], f_pts[1:-1], f_pts[2:]
    freqs = all_freqs[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rising = (freqs - lower) / (centre - lower)
        falling = (upper - freqs) / (upper - centre)
    fb = np.maximum(0.0, np.minimum(rising, falling))
    fb = np.nan_to_num(fb, nan=0.0, posinf=0.0, neginf=0.0)
    if norm == "slaney":
        fb = fb * (2.0 / (upper - lower))[None, :]

    if (fb.max(axis=0) == 0.0).any():
        warnings.warn(
            "At least one mel filterbank has all zero values. "
            f"The value for `n_mels` ({n_mels}) may be set too high. "
            f"Or, the value for `n_freqs` ({n_freqs}) may be set too low.",
            stacklevel=2,
        )
    return torch.from_numpy(fb.astype(np.float32))


# --------------------------------------------------------------------------- STFT


def _window_norm_mode(normalized) -> tuple[bool, bool]:
    """Returns (divide by the window's L2 norm, let torch.stft divide by sqrt(n_fft))."""
    if normalized is True or normalized == "window":
        return True, False
    if normalized is False:
        return False, False
    if normalized == "frame_length":
        return False, True
    raise ValueError(f'{_PREFIX}normalized must be a bool, "window" or "frame_length", got {normalized!r}')


def spectrogram(
    waveform: torch.Tensor,
    pad: int,
    window: torch.Tensor,
    n_fft: int,
    hop_length: int,
    win_length: int,
    power: float | None,
    normalized: bool | str,
    center: bool = True,
    pad_mode: str = "reflect",
    onesided: bool = True,
    return_complex: bool | None = None,
) -> torch.Tensor:
    """STFT of ``[..., time]`` -> ``[..., freq, frames]``.

    ``power=None`` returns the complex STFT; otherwise ``|STFT| ** power``.
    """
    if return_complex is not None:
        # Deprecated and without effect in torchaudio 2.x too.
        warnings.warn("`return_complex` is deprecated and has no effect.", stacklevel=2)
    by_window, by_frame = _window_norm_mode(normalized)
    if pad > 0:
        waveform = torch.nn.functional.pad(waveform, (pad, pad), "constant")
    shape = waveform.shape
    spec = torch.stft(
        waveform.reshape(-1, shape[-1]),
        n_fft=n_fft,
        hop_length=hop_length,
        win_length=win_length,
        window=window,
        center=center,
        pad_mode=pad_mode,
        normalized=by_frame,
        onesided=onesided,
        return_complex=True,
    )
    spec = spec.reshape(shape[:-1] + spec.shape[-2:])
    if by_window:
        spec = spec / window.pow(2.0).sum().sqrt()
    if power is None:
        return spec
    if power == 1.0:
        return spec.abs()
    return spec.abs().pow(power)


def inverse_spectrogram(
    spectrogram: torch.Tensor,
    length: int | None,
    pad: int,
    window: torch.Tensor,
    n_fft: int,
    hop_length: int,
    win_length: int,
    normalized: bool | str,
    center: bool = True,
    pad_mode: str = "reflect",
    onesided: bool = True,
) -> torch.Tensor:
    """Inverse STFT (overlap-add, ``torch.istft``) of complex ``[..., freq, frames]``.

    ``pad_mode`` is accepted for signature parity only: ``istft`` drops the
    centre padding whatever mode produced it.
    """
    if not spectrogram.is_complex():
        raise ValueError(f"{_PREFIX}expected `spectrogram` to be a complex tensor, got {spectrogram.dtype}")
    by_window, by_frame = _window_norm_mode(normalized)
    if by_window:
        spectrogram = spectrogram * window.pow(2.0).sum().sqrt()
    shape = spectrogram.shape
    if length is not None:
        length = length + 2 * pad
    waveform = torch.istft(
        spectrogram.reshape(-1, shape[-2], shape[-1]),
        n_fft=n_fft,
        hop_length=hop_length,
        win_length=win_length,
        window=window,
        center=center,
        normalized=by_frame,
        onesided=onesided,
        length=length,
        return_complex=False,
    )
    if pad > 0:
        waveform = waveform[:, pad:-pad]
    return waveform.reshape(shape[:-2] + waveform.shape[-1:])


def phase_vocoder(complex_specgrams: torch.Tensor, rate: float, phase_advance: torch.Tensor) -> torch.Tensor:
    """Time-stretch a complex ``[..., freq, frames]`` STFT by ``rate`` without changing pitch.

    Output frame ``j`` reads the input at fractional position ``t = j * rate``
    (``ceil(frames / rate)`` frames). Its magnitude is the linear interpolation
    of frames ``floor(t)`` and ``floor(t) + 1``; its phase is accumulated from
    each bin's measured instantaneous frequency: the expected advance per hop
    (``phase_advance``, ``omega_k * hop``) plus the wrapped deviation between the
    two frames' phases. Accumulating phase this way keeps every partial's
    frequency, so pitch survives while duration changes by ``1 / rate``.
    """
    if not complex_specgrams.is_complex():
        raise ValueError(f"{_PREFIX}expected a complex spectrogram, got {complex_specgrams.dtype}")
    if rate <= 0:
        raise ValueError(f"{_PREFIX}rate must be positive, got {rate!r}")
    if rate == 1.0:
        return complex_specgrams
    n_frames = complex_specgrams.shape[-1]
    real_dtype = phase_advance.dtype
    positions = torch.arange(0, n_frames, rate, device=complex_specgrams.device, dtype=real_dtype)
    frac = positions % 1.0
    left = positions.floor().long()

    # Two zero frames past the end so left + 1 is always a valid index.
    padded = torch.nn.functional.pad(complex_specgrams, (0, 2))
    frame_a = padded.index_select(-1, left)
    frame_b = padded.index_select(-1, left + 1)

    two_pi = 2.0 * math.pi
    deviation = frame_b.angle() - frame_a.angle() - phase_advance
    deviation = deviation - two_pi * torch.round(deviation / two_pi)  # wrap to [-pi, pi]
    step = deviation + phase_advance  # true phase advance per hop

    # Output frame 0 keeps the input's first phase; frame j adds the steps of frames < j.
    start_phase = complex_specgrams[..., :1].angle()
    phase = torch.cumsum(torch.cat([start_phase, step[..., :-1]], dim=-1), dim=-1)
    magnitude = (1.0 - frac) * frame_a.abs() + frac * frame_b.abs()
    return torch.polar(magnitude, phase)


# --------------------------------------------------------------------------- decibels


def amplitude_to_DB(  # noqa: N802 - torchaudio's name
    x: torch.Tensor,
    multiplier: float,
    amin: float,
    db_multiplier: float,
    top_db: float | None = None,
) -> torch.Tensor:
    """``multiplier * log10(max(x, amin)) - multiplier * db_multiplier``, floor-clipped at ``max - top_db``.

    The maximum for ``top_db`` is taken per item over the last three dims
    (channel, freq, time), or over the whole tensor when it has two dims.
    """
    x_db = multiplier * torch.log10(torch.clamp(x, min=amin))
    x_db = x_db - multiplier * db_multiplier
    if top_db is not None:
        if x_db.dim() <= 2:
            x_db = torch.maximum(x_db, x_db.amax() - top_db)
        else:
            shape = x_db.shape
            packed = x_db.reshape(-1, shape[-3], shape[-2], shape[-1])
            floor = packed.amax(dim=(-3, -2, -1)) - top_db
            x_db = torch.maximum(packed, floor.view(-1, 1, 1, 1)).reshape(shape)
    return x_db


def DB_to_amplitude(x: torch.Tensor, ref: float, power: float) -> torch.Tensor:  # noqa: N802
    """Inverse of ``amplitude_to_DB`` with multiplier ``10`` (``power=1``) or ``20`` (``power=0.5``)."""
    return ref * torch.pow(torch.pow(10.0, 0.1 * x), power)
