"""The torchaudio fallback: signal-level checks of each function, and the import hook.

The fallback package is imported here under its own name; the finder is only
exercised in subprocesses, so this process's ``sys.meta_path`` stays untouched.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni_edge.compat import torchaudio_fallback as ta
from vllm_omni_edge.compat.torchaudio_fallback import functional as AF
from vllm_omni_edge.compat.torchaudio_fallback import transforms as T

REPO = Path(__file__).resolve().parents[1]
PKG_DIR = REPO / "vllm_omni_edge" / "compat" / "torchaudio_fallback"


def sine(freq: float, sr: int, seconds: float = 1.0, amp: float = 0.5, dtype=torch.float32) -> torch.Tensor:
    t = torch.arange(int(sr * seconds), dtype=torch.float64) / sr
    return (amp * torch.sin(2 * math.pi * freq * t)).to(dtype)


def peak_hz(x: np.ndarray | torch.Tensor, sr: int) -> float:
    """Frequency of the strongest FFT bin, refined by parabolic interpolation."""
    x = np.asarray(x, dtype=np.float64).ravel()
    mag = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    k = int(np.argmax(mag[1:-1])) + 1
    a, b, c = np.log(mag[k - 1 : k + 2] + 1e-30)
    offset = 0.5 * (a - c) / (a - 2 * b + c)
    return (k + offset) * sr / x.size


def run_python(code: str, env_extra: dict | None = None, timeout: int = 120) -> str:
    """Run code in a fresh interpreter (clean sys.modules / sys.meta_path); return stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed:\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc.stdout


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


# --------------------------------------------------------------------------- resample


@pytest.mark.parametrize(
    ("orig", "new", "freq"), [(16000, 24000, 440.0), (44100, 16000, 1000.0), (24000, 22050, 3000.0)]
)
def test_resample_keeps_frequency_length_and_alignment(orig, new, freq):
    x = sine(freq, orig, seconds=0.5)
    batch = torch.stack([torch.stack([x, -x, 0.5 * x]), torch.stack([x, x, x])])  # [2, 3, T]
    y = AF.resample(batch, orig, new)

    expected_len = math.ceil(x.numel() * new / orig)
    assert y.shape == (2, 3, expected_len)
    assert y.dtype == torch.float32
    assert abs(peak_hz(y[0, 0], new) - freq) < 1.0
    # Sample-accurate: output sample k is the sine at time k / new (no filter delay).
    t = torch.arange(expected_len, dtype=torch.float64) / new
    ref = 0.5 * torch.sin(2 * math.pi * freq * t)
    interior = slice(200, expected_len - 200)
    assert torch.max(torch.abs(y[0, 0].double() - ref)[interior]) < 2e-3
    # Batch items are independent and linear.
    torch.testing.assert_close(y[0, 1], -y[0, 0])
    torch.testing.assert_close(y[0, 2], 0.5 * y[0, 0])
    torch.testing.assert_close(y[1, 0], y[0, 0])


def test_resample_dtype_1d_and_identity():
    x = sine(440.0, 16000, dtype=torch.float64)
    y = AF.resample(x, 16000, 8000)
    assert y.dtype == torch.float64 and y.shape == (8000,)
    assert abs(peak_hz(y, 8000) - 440.0) < 1.0
    half = AF.resample(x.half(), 16000, 8000)
    assert half.dtype == torch.float16
    assert AF.resample(x, 16000, 16000) is x  # same rate: returned untouched, like torchaudio
    # Transform and functional agree; argument names are torchaudio's.
    torch.testing.assert_close(T.Resample(orig_freq=16000, new_freq=8000, dtype=torch.float32)(x), y)
    assert AF.resample(torch.zeros(2, 0), 16000, 8000).shape == (2, 0)


def test_resample_is_band_limited():
    # 12 kHz is above the 8 kHz Nyquist of a 16 kHz output: it must be filtered, not folded to 4 kHz.
    x = sine(12000.0, 48000)
    y = AF.resample(x, 48000, 16000)
    assert y[1000:-1000].abs().max() < 1e-3
    # A tone inside the pass band keeps its amplitude.
    y_pass = AF.resample(sine(5000.0, 48000), 48000, 16000)
    assert abs(float(y_pass[1000:-1000].abs().max()) - 0.5) < 5e-3


def test_resample_rejects_unsupported_arguments():
    x = sine(440.0, 16000)
    with pytest.raises(ValueError, match="resampling_method='sinc_interp_kaiser' is not supported"):
        AF.resample(x, 16000, 8000, resampling_method="sinc_interp_kaiser")
    with pytest.raises(ValueError, match="rolloff"):
        T.Resample(16000, 8000, rolloff=0.9)
    with pytest.raises(ValueError, match="integer"):
        AF.resample(x, 16000.5, 8000)
    with pytest.raises(TypeError, match="floating point"):
        AF.resample(torch.zeros(10, dtype=torch.int16), 16000, 8000)


# --------------------------------------------------------------------------- load / save


def test_wav_round_trip_float_and_int16(tmp_path):
    sr = 16000
    x = torch.stack([sine(440.0, sr, 0.25), sine(880.0, sr, 0.25, amp=0.25)])  # [2, T]

    path = tmp_path / "float.wav"
    ta.save(str(path), x, sr)  # float32 tensor -> 32-bit float WAV, lossless
    y, got_sr = ta.load(path)
    assert got_sr == sr and y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    meta = ta.info(path)
    assert (meta.sample_rate, meta.num_frames, meta.num_channels) == (sr, x.shape[1], 2)
    assert (meta.encoding, meta.bits_per_sample) == ("PCM_F", 32)

    path16 = tmp_path / "pcm16.wav"
    ta.save(path16, x, sr, bits_per_sample=16)
    y16, _ = ta.load(path16)
    assert y16.shape == x.shape and y16.dtype == torch.float32
    assert torch.max(torch.abs(y16 - x)) <= 1.0 / 32768 + 1e-7
    native, _ = ta.load(path16, normalize=False)
    assert native.dtype == torch.int16 and native.shape == x.shape
    torch.testing.assert_close(native.float() / 32768.0, y16, rtol=0, atol=0)
    assert ta.info(path16).bits_per_sample == 16

    # int16 tensor -> PCM_16 by default, read back bit-exact.
    ints = (x * 32767).round().to(torch.int16)
    ta.save(tmp_path / "ints.wav", ints, sr)
    back, _ = ta.load(tmp_path / "ints.wav", normalize=False)
    assert torch.equal(back, ints)

    # channels_first=False is [T, C]; frame_offset / num_frames cut the time axis.
    tc, _ = ta.load(path, channels_first=False)
    assert tc.shape == (x.shape[1], 2)
    part, _ = ta.load(path, frame_offset=100, num_frames=50)
    torch.testing.assert_close(part, x[:, 100:150], rtol=0, atol=0)


def test_save_load_file_like_and_clipping():
    buf = io.BytesIO()
    loud = torch.tensor([[0.0, 2.0, -2.0, 0.5]])
    ta.save(buf, loud, 8000, format="wav", encoding="PCM_S", bits_per_sample=16)
    buf.seek(0)
    y, sr = ta.load(buf)
    assert sr == 8000 and y.shape == (1, 4)
    # Out-of-range floats saturate instead of wrapping around.
    assert y[0, 1] > 0.999 and y[0, 2] < -0.999 and abs(float(y[0, 3]) - 0.5) < 1e-4
    with pytest.raises(ValueError, match="format"):
        ta.save(io.BytesIO(), loud, 8000)
    with pytest.raises(ValueError, match="compression"):
        ta.save(io.BytesIO(), loud, 8000, format="flac", compression=5)


def test_flac_round_trip(tmp_path):
    x = sine(440.0, 16000, 0.1).unsqueeze(0)
    ta.save(tmp_path / "a.flac", x, 16000)  # FLAC cannot hold floats: 24-bit PCM
    y, sr = ta.load(tmp_path / "a.flac")
    assert sr == 16000 and y.shape == x.shape
    assert torch.max(torch.abs(y - x)) < 1e-6
    assert ta.info(tmp_path / "a.flac").encoding == "FLAC"


# --------------------------------------------------------------------------- mel filterbanks


def _ref_hz_to_mel(f: float, scale: str) -> float:
    if scale == "htk":
        return 2595.0 * math.log10(1.0 + f / 700.0)
    if f < 1000.0:
        return 3.0 * f / 200.0
    return 15.0 + 27.0 * math.log(f / 1000.0) / math.log(6.4)


def _ref_mel_to_hz(m: float, scale: str) -> float:
    if scale == "htk":
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    if m < 15.0:
        return 200.0 * m / 3.0
    return 1000.0 * 6.4 ** ((m - 15.0) / 27.0)


def _ref_fbanks(n_freqs, f_min, f_max, n_mels, sr, norm, scale) -> np.ndarray:
    """Per-element triangle evaluation, written independently of the implementation."""
    lo, hi = _ref_hz_to_mel(f_min, scale), _ref_hz_to_mel(f_max, scale)
    edges = [_ref_mel_to_hz(lo + (hi - lo) * i / (n_mels + 1), scale) for i in range(n_mels + 2)]
    out = np.zeros((n_freqs, n_mels))
    for k in range(n_freqs):
        f = k * (sr // 2) / (n_freqs - 1)
        for m in range(n_mels):
            a, b, c = edges[m], edges[m + 1], edges[m + 2]
            if a < f <= b:
                v = (f - a) / (b - a)
            elif b < f < c:
                v = (c - f) / (c - b)
            else:
                v = 0.0
            out[k, m] = v * (2.0 / (c - a) if norm == "slaney" else 1.0)
    return out


@pytest.mark.parametrize(
    ("norm", "scale", "n_fft", "n_mels", "sr", "f_min", "f_max"),
    [
        (None, "htk", 400, 40, 16000, 0.0, 8000.0),
        ("slaney", "slaney", 1024, 80, 22050, 0.0, 8000.0),
        ("slaney", "htk", 512, 64, 16000, 20.0, 7600.0),
    ],
)
def test_melscale_fbanks_matches_reference(norm, scale, n_fft, n_mels, sr, f_min, f_max):
    n_freqs = n_fft // 2 + 1
    fb = AF.melscale_fbanks(n_freqs, f_min, f_max, n_mels, sr, norm=norm, mel_scale=scale)
    assert fb.shape == (n_freqs, n_mels) and fb.dtype == torch.float32
    ref = _ref_fbanks(n_freqs, f_min, f_max, n_mels, sr, norm, scale)
    np.testing.assert_allclose(fb.numpy(), ref, rtol=1e-5, atol=1e-7)


def test_melscale_fbanks_properties():
    sr, n_freqs, n_mels = 16000, 513, 40
    fb = AF.melscale_fbanks(n_freqs, 0.0, 8000.0, n_mels, sr).numpy()
    freqs = np.linspace(0, sr // 2, n_freqs)
    # Known anchors: HTK mel(700 Hz) = 2595 * log10(2); filter centres evenly spaced in mel.
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    centres = 700.0 * (10 ** (np.linspace(0, mel(8000.0), n_mels + 2)[1:-1] / 2595.0) - 1)
    bin_hz = freqs[1]
    # The sampled peak is one of the two bins around the centre.
    assert np.all(np.abs(freqs[fb.argmax(axis=0)] - centres) < bin_hz)
    assert fb.max() <= 1.0 + 1e-6
    # Adjacent triangles partition unity between the first and last centres.
    inside = (freqs >= centres[0]) & (freqs <= centres[-1])
    np.testing.assert_allclose(fb[inside].sum(axis=1), 1.0, atol=1e-5)

    # Slaney norm: each triangle has unit area (in Hz), checked where filters span many bins.
    fbs = AF.melscale_fbanks(n_freqs, 0.0, 8000.0, n_mels, sr, norm="slaney", mel_scale="slaney").numpy()
    widths = (fbs > 0).sum(axis=0)
    areas = fbs.sum(axis=0) * bin_hz
    assert np.all(np.abs(areas[widths > 20] - 1.0) < 0.02)
    assert (widths > 20).sum() > 10
    # Slaney scale is linear below 1 kHz: low centres are equally spaced in Hz.
    low_peaks = freqs[fbs.argmax(axis=0)][:8]
    assert np.ptp(np.diff(low_peaks)) <= 2 * bin_hz

    with pytest.raises(ValueError):
        AF.melscale_fbanks(n_freqs, 0.0, 8000.0, n_mels, sr, norm="area")
    with pytest.raises(ValueError):
        AF.melscale_fbanks(n_freqs, 0.0, 8000.0, n_mels, sr, mel_scale="kaldi")


# --------------------------------------------------------------------------- STFT family


def test_spectrogram_matches_torch_stft():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4000)
    spec = T.Spectrogram(n_fft=512, hop_length=128, power=2.0)(x)
    window = torch.hann_window(512)
    ref = torch.stft(x.reshape(-1, 4000), 512, 128, 512, window, center=True, pad_mode="reflect", return_complex=True)
    assert spec.shape == (2, 3) + ref.shape[-2:]
    torch.testing.assert_close(spec.reshape(ref.shape), ref.abs() ** 2)

    mag = T.Spectrogram(n_fft=512, win_length=400, hop_length=160, power=1.0, normalized=True)(x[0, 0])
    ref2 = torch.stft(x[0, 0], 512, 160, 400, torch.hann_window(400), return_complex=True).abs()
    torch.testing.assert_close(mag, ref2 / torch.hann_window(400).pow(2).sum().sqrt())

    cplx = T.Spectrogram(n_fft=256, power=None)(x[0])
    assert cplx.is_complex() and cplx.shape[-2] == 129
    # Default hop is win_length // 2.
    assert cplx.shape[-1] == 4000 // 128 + 1


@pytest.mark.parametrize(("pad", "normalized"), [(0, False), (16, True), (0, "frame_length")])
def test_inverse_spectrogram_reconstructs(pad, normalized):
    torch.manual_seed(1)
    x = torch.randn(2, 5000, dtype=torch.float64)
    kw = dict(n_fft=400, hop_length=100, pad=pad, normalized=normalized, window_fn=torch.hann_window)
    spec = T.Spectrogram(power=None, **kw).double()(x)
    y = T.InverseSpectrogram(**kw).double()(spec, length=x.shape[-1])
    assert y.shape == x.shape
    torch.testing.assert_close(y, x, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="complex"):
        T.InverseSpectrogram(n_fft=400)(spec.abs())


def _ref_phase_vocoder(spec: np.ndarray, rate: float, hop: int) -> np.ndarray:
    """Textbook loop form: walk the input at `rate`, advance each bin by its measured frequency."""
    n_freq, n_frames = spec.shape
    expected = np.pi * hop * np.arange(n_freq) / (n_freq - 1)  # omega_k * hop
    padded = np.concatenate([spec, np.zeros((n_freq, 2))], axis=1)
    phase = np.angle(spec[:, 0])
    out = []
    for t in np.arange(0, n_frames, rate):
        i, a = int(t), t - int(t)
        out.append(((1 - a) * np.abs(padded[:, i]) + a * np.abs(padded[:, i + 1])) * np.exp(1j * phase))
        dev = np.angle(padded[:, i + 1]) - np.angle(padded[:, i]) - expected
        phase = phase + expected + (dev - 2 * np.pi * np.round(dev / (2 * np.pi)))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("rate", [2.0, 0.5, 1.3])
def test_phase_vocoder_matches_reference(rate):
    torch.manual_seed(3)
    n_fft, hop = 256, 64
    x = torch.randn(2, 3000, dtype=torch.float64)
    spec = AF.spectrogram(x, 0, torch.hann_window(n_fft, dtype=torch.float64), n_fft, hop, n_fft, None, False)
    advance = torch.linspace(0, math.pi * hop, n_fft // 2 + 1, dtype=torch.float64)[..., None]
    out = AF.phase_vocoder(spec, rate, advance)
    assert out.shape == (2, n_fft // 2 + 1, math.ceil(spec.shape[-1] / rate))
    for b in range(2):
        np.testing.assert_allclose(out[b].numpy(), _ref_phase_vocoder(spec[b].numpy(), rate, hop), atol=1e-8)


def test_time_stretch_changes_duration_not_pitch():
    sr, n_fft, hop = 16000, 512, 128
    # A cosine is continuous under the STFT's reflect padding at t=0. (A sine's
    # reflected onset gives wrong phase steps in the first frames, and a phase
    # vocoder carries such phase offsets forever: real torchaudio does the same.)
    x = torch.cos(2 * math.pi * 440.0 * torch.arange(sr) / sr) * 0.5
    window = torch.hann_window(n_fft)
    spec = AF.spectrogram(x, 0, window, n_fft, hop, n_fft, None, False)
    n_frames = spec.shape[-1]
    stretch = T.TimeStretch(hop_length=hop, n_freq=n_fft // 2 + 1)

    fast = stretch(spec, 2.0)
    assert fast.shape == (n_fft // 2 + 1, math.ceil(n_frames / 2))
    slow = T.TimeStretch(hop_length=hop, n_freq=n_fft // 2 + 1, fixed_rate=0.5)(spec)
    assert slow.shape[-1] == 2 * n_frames
    torch.testing.assert_close(stretch(spec, overriding_rate=0.5), slow)

    for stretched, rate in ((fast, 2.0), (slow, 0.5)):
        y = AF.inverse_spectrogram(stretched, int(x.numel() / rate), 0, window, n_fft, hop, n_fft, False)
        assert y.shape[-1] == int(x.numel() / rate)
        assert abs(peak_hz(y[n_fft:-n_fft], sr) - 440.0) < 1.0
        # A clean tone stays a clean tone at its level.
        rms = float(y[n_fft:-n_fft].pow(2).mean().sqrt())
        assert abs(rms - 0.5 / math.sqrt(2)) < 0.01

    assert torch.equal(stretch(spec, 1.0), spec)
    with pytest.raises(ValueError, match="fixed_rate"):
        stretch(spec)
    with pytest.raises(ValueError, match="complex"):
        stretch(spec.abs(), 2.0)


def test_mel_spectrogram_shape_and_composition():
    torch.manual_seed(2)
    x = torch.randn(3, 8000)
    mel = T.MelSpectrogram(sample_rate=16000, n_fft=400, hop_length=160, n_mels=80, norm="slaney", mel_scale="slaney")
    out = mel(waveform=x)
    assert out.shape == (3, 80, 8000 // 160 + 1)
    spec = T.Spectrogram(n_fft=400, hop_length=160)(x)
    fb = AF.melscale_fbanks(201, 0.0, 8000.0, 80, 16000, "slaney", "slaney")
    torch.testing.assert_close(out, torch.einsum("cft,fm->cmt", spec, fb))
    # Buffer names match torchaudio's so its state dicts load.
    assert set(mel.state_dict()) == {"spectrogram.window", "mel_scale.fb"}
    # A tone lands in the mel band containing its frequency.
    tone = T.MelSpectrogram(sample_rate=16000, n_fft=1024, n_mels=64, power=1.0)(sine(2000.0, 16000))
    band = int(tone.mean(dim=-1).argmax())
    fb64 = AF.melscale_fbanks(513, 0.0, 8000.0, 64, 16000)
    assert fb64[round(2000 / (8000 / 512)), band] > 0.5


def test_amplitude_to_db():
    x = torch.tensor([[1.0, 10.0, 100.0, 1e-20]])
    db = T.AmplitudeToDB(stype="power", top_db=30.0)(x)
    torch.testing.assert_close(db, torch.tensor([[0.0, 10.0, 20.0, -10.0]]))
    torch.testing.assert_close(AF.DB_to_amplitude(db[:, :3], 1.0, 1.0), x[:, :3])


# --------------------------------------------------------------------------- the import hook

_FINDER_CHECK = """
    import importlib.util, json, sys
    assert "torchaudio" not in sys.modules
    from vllm_omni_edge.compat.torchaudio_fallback.finder import install, is_real_torchaudio_available
    real_before = is_real_torchaudio_available()
    assert "torchaudio" not in sys.modules, "the availability check must not import torchaudio"
    msg1, msg2 = install(), install()
    n_finders = sum(type(f).__name__ == "TorchaudioFallbackFinder" for f in sys.meta_path)
    last = type(sys.meta_path[-1]).__name__
    import torchaudio
    from torchaudio.functional import melscale_fbanks
    import torchaudio.transforms
    from torchaudio import transforms, functional
    import torchaudio.functional as AF
    try:
        import torchaudio.compliance.kaldi
        kaldi = "imported"
    except ModuleNotFoundError:
        kaldi = "missing"
    x = torchaudio.functional.resample(__import__("torch").ones(1, 160), 16000, 8000)
    print(json.dumps({
        "real_before": real_before, "msg1": msg1, "msg2": msg2, "n_finders": n_finders, "last": last,
        "file": torchaudio.__file__, "version": torchaudio.__version__,
        "same_functional": functional is AF is sys.modules["torchaudio.functional"],
        "fb_shape": list(melscale_fbanks(201, 0.0, 8000.0, 80, 16000).shape),
        "transforms_name": transforms.Spectrogram.__module__, "kaldi": kaldi,
        "resampled": list(x.shape), "real_after": is_real_torchaudio_available(),
    }))
"""


def test_finder_serves_torchaudio_in_clean_interpreter():
    out = last_json(run_python(_FINDER_CHECK))
    assert out["real_before"] is False and out["real_after"] is False
    assert out["msg1"].startswith("fallback installed") and out["msg2"] == out["msg1"]
    assert out["n_finders"] == 1 and out["last"] == "TorchaudioFallbackFinder"
    assert Path(out["file"]).resolve() == (PKG_DIR / "__init__.py").resolve()
    assert out["version"].endswith("+edgefallback")
    assert out["same_functional"] is True
    assert out["fb_shape"] == [201, 80]
    assert out["transforms_name"] == "torchaudio.transforms"
    assert out["kaldi"] == "missing"
    assert out["resampled"] == [1, 80]


def test_real_torchaudio_wins(tmp_path):
    fake = tmp_path / "torchaudio"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '9.9.9'\nREAL = True\n")
    code = """
        import json, sys
        from vllm_omni_edge.compat.torchaudio_fallback.finder import install, is_real_torchaudio_available
        avail = is_real_torchaudio_available()
        msg = install()
        import torchaudio
        print(json.dumps({"avail": avail, "msg": msg, "real": getattr(torchaudio, "REAL", False)}))
    """
    out = last_json(run_python(code, {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}))
    assert out["avail"] is True and out["real"] is True
    assert out["msg"].startswith("real torchaudio")


def test_patch_module_applies_the_finder():
    code = """
        import json, sys
        from vllm_omni_edge.patches.base import apply_patch_module
        import vllm_omni_edge.patches.common.torchaudio_fallback as mod
        outcome = apply_patch_module("vllm_omni_edge.patches.common.torchaudio_fallback")
        import torchaudio
        print(json.dumps({"status": outcome.status, "detail": outcome.detail, "record": mod.RECORD.as_dict(),
                          "fallback": getattr(torchaudio, "__vllm_omni_edge_fallback__", False)}))
    """
    out = last_json(run_python(code))
    assert out["status"] == "applied", out
    assert out["detail"].startswith("fallback installed")
    assert out["fallback"] is True
    rec = out["record"]
    assert rec["name"] == "torchaudio_fallback" and rec["process"] == "worker" and rec["package"] == "vllm-omni"
    assert rec["target"] == "sys.meta_path (module name 'torchaudio')"
    assert rec["vllm_versions"] == ["0.30.0"]


_MIXIN_CHECK = """
    import importlib.util, json, os, sys, types
    from vllm_omni_edge.compat.torchaudio_fallback.finder import install
    install()
    stubbed = False
    if importlib.util.find_spec("torchvision") is None:
        # vllm_omni.entrypoints.openai/__init__ imports the whole API server, which needs
        # torchvision (absent here for the same ABI reason, not torchaudio's business).
        # Register the package without running its __init__ so the mixin module itself,
        # and its module-level `import torchaudio`, is what gets tested.
        entry = importlib.util.find_spec("vllm_omni.entrypoints")
        pkg = types.ModuleType("vllm_omni.entrypoints.openai")
        pkg.__path__ = [os.path.join(os.path.dirname(entry.origin), "openai")]
        sys.modules["vllm_omni.entrypoints.openai"] = pkg
        stubbed = True
    import numpy as np
    import vllm_omni.entrypoints.openai.audio_utils_mixin as mixin_mod
    import vllm_omni.utils.audio as omni_audio
    import torchaudio

    def peak_hz(x, sr):
        x = np.asarray(x, dtype=np.float64).ravel()
        mag = np.abs(np.fft.rfft(x * np.hanning(x.size)))
        k = int(np.argmax(mag[1:-1])) + 1
        a, b, c = np.log(mag[k - 1 : k + 2] + 1e-30)
        return (k + 0.5 * (a - c) / (a - 2 * b + c)) * sr / x.size

    sr = 24000
    t = np.arange(sr) / sr
    # Cosine: continuous under the STFT's reflect padding (see test_time_stretch...).
    mono = (0.5 * np.cos(2 * np.pi * 440.0 * t)).astype(np.float32)
    stereo = np.stack([mono, 0.5 * mono], axis=1)  # soundfile layout [T, C]
    mixin = mixin_mod.AudioMixin()
    res = {"stubbed": stubbed, "torchaudio_file": torchaudio.__file__}
    for speed in (2.0, 0.5):
        y, out_sr = mixin._apply_speed_adjustment(mono, speed, sr)
        res[f"speed{speed}"] = {"len": int(y.shape[0]), "sr": out_sr, "pitch": peak_hz(y[1000:-1000], sr),
                                "rms": float(np.sqrt(np.mean(y[1000:-1000] ** 2)))}
    ys, _ = mixin._apply_speed_adjustment(stereo, 1.5, sr)
    res["stereo_speed_shape"] = list(ys.shape)
    r = mixin_mod.AudioMixin._resample_audio(stereo, sr, 16000)
    res["resample"] = {"shape": list(r.shape), "pitch": peak_hz(r[:, 0], 16000),
                       "ratio": float(np.abs(r[:, 1]).max() / np.abs(r[:, 0]).max())}
    fb = omni_audio.mel_filter_bank(sr=16000, n_fft=400, n_mels=80)
    res["mel_filter_bank"] = list(fb.shape)
    print(json.dumps(res))
"""


def test_audio_utils_mixin_runs_on_fallback():
    out = last_json(run_python(_MIXIN_CHECK, timeout=300))
    assert Path(out["torchaudio_file"]).resolve() == (PKG_DIR / "__init__.py").resolve()
    sr = 24000
    for speed in (2.0, 0.5):
        r = out[f"speed{speed}"]
        assert r["len"] == int(sr / speed) and r["sr"] == sr
        assert abs(r["pitch"] - 440.0) < 2.0, r  # speed changes duration, not pitch
        assert abs(r["rms"] - 0.5 / math.sqrt(2)) < 0.01, r
    assert out["stereo_speed_shape"] == [int(sr / 1.5), 2]
    assert out["resample"]["shape"] == [16000, 2]
    assert abs(out["resample"]["pitch"] - 440.0) < 1.0
    assert abs(out["resample"]["ratio"] - 0.5) < 1e-3
    assert out["mel_filter_bank"] == [80, 201]
