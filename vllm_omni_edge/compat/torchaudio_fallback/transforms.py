"""``torchaudio.transforms`` subset: ``nn.Module`` wrappers over ``functional``.

Buffer names (``window``, ``fb``, ``phase_advance``) match torchaudio's so
state dicts saved with real torchaudio modules load into these and back.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from . import functional as F

__all__ = [
    "AmplitudeToDB",
    "InverseSpectrogram",
    "MelScale",
    "MelSpectrogram",
    "Resample",
    "Spectrogram",
    "TimeStretch",
]

_PREFIX = "torchaudio fallback: "


def _make_window(window_fn: Callable[..., torch.Tensor], win_length: int, wkwargs: dict | None) -> torch.Tensor:
    return window_fn(win_length) if wkwargs is None else window_fn(win_length, **wkwargs)


class Spectrogram(torch.nn.Module):
    """Waveform ``[..., time]`` -> spectrogram ``[..., freq, frames]`` (see ``functional.spectrogram``)."""

    def __init__(
        self,
        n_fft: int = 400,
        win_length: int | None = None,
        hop_length: int | None = None,
        pad: int = 0,
        window_fn: Callable[..., torch.Tensor] = torch.hann_window,
        power: float | None = 2.0,
        normalized: bool | str = False,
        wkwargs: dict | None = None,
        center: bool = True,
        pad_mode: str = "reflect",
        onesided: bool = True,
        return_complex: bool | None = None,
    ) -> None:
        super().__init__()
        if return_complex is not None:
            # Deprecated and without effect in torchaudio 2.x: power=None alone selects complex output.
            warnings.warn("`return_complex` is deprecated and has no effect.", stacklevel=2)
        F._window_norm_mode(normalized)  # validate early
        self.n_fft = n_fft
        self.win_length = win_length if win_length is not None else n_fft
        self.hop_length = hop_length if hop_length is not None else self.win_length // 2
        self.register_buffer("window", _make_window(window_fn, self.win_length, wkwargs))
        self.pad = pad
        self.power = power
        self.normalized = normalized
        self.center = center
        self.pad_mode = pad_mode
        self.onesided = onesided

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return F.spectrogram(
            waveform,
            self.pad,
            self.window,
            self.n_fft,
            self.hop_length,
            self.win_length,
            self.power,
            self.normalized,
            self.center,
            self.pad_mode,
            self.onesided,
        )


class InverseSpectrogram(torch.nn.Module):
    """Complex ``[..., freq, frames]`` -> waveform ``[..., time]`` via ``torch.istft``."""

    def __init__(
        self,
        n_fft: int = 400,
        win_length: int | None = None,
        hop_length: int | None = None,
        pad: int = 0,
        window_fn: Callable[..., torch.Tensor] = torch.hann_window,
        normalized: bool | str = False,
        wkwargs: dict | None = None,
        center: bool = True,
        pad_mode: str = "reflect",
        onesided: bool = True,
    ) -> None:
        super().__init__()
        F._window_norm_mode(normalized)
        self.n_fft = n_fft
        self.win_length = win_length if win_length is not None else n_fft
        self.hop_length = hop_length if hop_length is not None else self.win_length // 2
        self.register_buffer("window", _make_window(window_fn, self.win_length, wkwargs))
        self.pad = pad
        self.normalized = normalized
        self.center = center
        self.pad_mode = pad_mode
        self.onesided = onesided

    def forward(self, spectrogram: torch.Tensor, length: int | None = None) -> torch.Tensor:
        return F.inverse_spectrogram(
            spectrogram,
            length,
            self.pad,
            self.window,
            self.n_fft,
            self.hop_length,
            self.win_length,
            self.normalized,
            self.center,
            self.pad_mode,
            self.onesided,
        )


class MelScale(torch.nn.Module):
    """Linear-frequency spectrogram ``[..., n_stft, frames]`` -> ``[..., n_mels, frames]``."""

    def __init__(
        self,
        n_mels: int = 128,
        sample_rate: int = 16000,
        f_min: float = 0.0,
        f_max: float | None = None,
        n_stft: int = 201,
        norm: str | None = None,
        mel_scale: str = "htk",
    ) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.sample_rate = sample_rate
        self.f_max = f_max if f_max is not None else float(sample_rate // 2)
        self.f_min = f_min
        self.norm = norm
        self.mel_scale = mel_scale
        if f_min > self.f_max:
            raise ValueError(f"Require f_min: {f_min} <= f_max: {self.f_max}")
        fb = F.melscale_fbanks(n_stft, self.f_min, self.f_max, self.n_mels, self.sample_rate, norm, mel_scale)
        self.register_buffer("fb", fb)

    def forward(self, specgram: torch.Tensor) -> torch.Tensor:
        if specgram.shape[-2] != self.fb.shape[0]:
            raise ValueError(
                f"{_PREFIX}MelScale expects {self.fb.shape[0]} frequency bins (n_stft), got {specgram.shape[-2]}"
            )
        fb = self.fb if self.fb.dtype == specgram.dtype else self.fb.to(specgram.dtype)
        return torch.matmul(specgram.transpose(-1, -2), fb).transpose(-1, -2)


class MelSpectrogram(torch.nn.Module):
    """``Spectrogram`` followed by ``MelScale``: waveform ``[..., time]`` -> ``[..., n_mels, frames]``."""

    def __init__(
        self,
        sample_rate: int = 16000,
        n_fft: int = 400,
        win_length: int | None = None,
        hop_length: int | None = None,
        f_min: float = 0.0,
        f_max: float | None = None,
        pad: int = 0,
        n_mels: int = 128,
        window_fn: Callable[..., torch.Tensor] = torch.hann_window,
        power: float = 2.0,
        normalized: bool | str = False,
        wkwargs: dict | None = None,
        center: bool = True,
        pad_mode: str = "reflect",
        onesided: bool | None = None,
        norm: str | None = None,
        mel_scale: str = "htk",
    ) -> None:
        super().__init__()
        if onesided is not None and not onesided:
            # A mel filterbank only covers the non-negative half of the spectrum.
            raise ValueError(f"{_PREFIX}MelSpectrogram requires a one-sided spectrogram (onesided=False given)")
        if power is None:
            raise ValueError(f"{_PREFIX}MelSpectrogram needs a real power spectrogram (power=None given)")
        self.sample_rate = sample_rate
        self.n_fft = n_fft
        self.win_length = win_length if win_length is not None else n_fft
        self.hop_length = hop_length if hop_length is not None else self.win_length // 2
        self.pad = pad
        self.power = power
        self.normalized = normalized
        self.n_mels = n_mels
        self.f_max = f_max
        self.f_min = f_min
        self.spectrogram = Spectrogram(
            n_fft=self.n_fft,
            win_length=self.win_length,
            hop_length=self.hop_length,
            pad=self.pad,
            window_fn=window_fn,
            power=self.power,
            normalized=self.normalized,
            wkwargs=wkwargs,
            center=center,
            pad_mode=pad_mode,
            onesided=True,
        )
        self.mel_scale = MelScale(
            self.n_mels, self.sample_rate, self.f_min, self.f_max, self.n_fft // 2 + 1, norm, mel_scale
        )

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return self.mel_scale(self.spectrogram(waveform))


class TimeStretch(torch.nn.Module):
    """Phase-vocoder time stretch of a complex STFT (``rate > 1`` is faster / shorter)."""

    def __init__(self, hop_length: int | None = None, n_freq: int = 201, fixed_rate: float | None = None) -> None:
        super().__init__()
        self.fixed_rate = fixed_rate
        n_fft = (n_freq - 1) * 2
        hop_length = hop_length if hop_length is not None else n_fft // 2
        # Expected phase advance of bin k over one hop: omega_k * hop, omega_k = pi * k / (n_freq - 1).
        self.register_buffer("phase_advance", torch.linspace(0, torch.pi * hop_length, n_freq)[..., None])

    def forward(self, complex_specgrams: torch.Tensor, overriding_rate: float | None = None) -> torch.Tensor:
        if not torch.is_tensor(complex_specgrams) or not complex_specgrams.is_complex():
            raise ValueError(f"{_PREFIX}TimeStretch expects a complex spectrogram (Spectrogram(power=None))")
        if complex_specgrams.shape[-2] != self.phase_advance.shape[0]:
            raise ValueError(
                f"{_PREFIX}TimeStretch built for n_freq={self.phase_advance.shape[0]}, "
                f"got {complex_specgrams.shape[-2]} frequency bins"
            )
        if overriding_rate is None:
            if self.fixed_rate is None:
                raise ValueError("If no fixed_rate is specified, must pass a valid rate to the forward method.")
            rate = self.fixed_rate
        else:
            rate = overriding_rate
        return F.phase_vocoder(complex_specgrams, rate, self.phase_advance)


class Resample(torch.nn.Module):
    """Resample ``[..., time]`` from ``orig_freq`` to ``new_freq`` with soxr (see ``functional.resample``).

    ``dtype`` only sets torchaudio's precomputed kernel precision; there is no
    kernel here and the input's dtype is kept, so it is accepted and unused.
    """

    def __init__(
        self,
        orig_freq: int = 16000,
        new_freq: int = 16000,
        resampling_method: str = "sinc_interp_hann",
        lowpass_filter_width: int = 6,
        rolloff: float = 0.99,
        beta: float | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.orig_freq = F._check_rate("orig_freq", orig_freq)
        self.new_freq = F._check_rate("new_freq", new_freq)
        F._check_resample_options(resampling_method, lowpass_filter_width, rolloff, beta)
        self.resampling_method = resampling_method
        self.lowpass_filter_width = lowpass_filter_width
        self.rolloff = rolloff
        self.beta = beta

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return F.resample(
            waveform,
            self.orig_freq,
            self.new_freq,
            self.lowpass_filter_width,
            self.rolloff,
            self.resampling_method,
            self.beta,
        )


class AmplitudeToDB(torch.nn.Module):
    """Power (``stype="power"``) or magnitude spectrogram -> decibels."""

    def __init__(self, stype: str = "power", top_db: float | None = None) -> None:
        super().__init__()
        if stype not in ("power", "magnitude"):
            raise ValueError(f'{_PREFIX}stype must be "power" or "magnitude", got {stype!r}')
        if top_db is not None and top_db < 0:
            raise ValueError("top_db must be positive value")
        self.stype = stype
        self.top_db = top_db
        self.multiplier = 10.0 if stype == "power" else 20.0
        self.amin = 1e-10
        self.ref_value = 1.0
        self.db_multiplier = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.amplitude_to_DB(x, self.multiplier, self.amin, self.db_multiplier, self.top_db)
