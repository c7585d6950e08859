"""lazy_imports: deferred packages wait for their first use, then work; triton is hidden on CPU torch."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading

import pytest

from vllm_omni_edge.levers import LeverFlagError
from vllm_omni_edge.patches.common import lazy_imports

DEFERRED_ON_TEXT_PATH = ("av", "cv2", "scipy.signal", "scipy.optimize")

_STATE = (
    "import importlib.util, json, sys\n"
    "from vllm_omni_edge.patches.common import lazy_imports as L\n"
    "def state(n):\n"
    "    m = sys.modules.get(n, 'absent')\n"
    "    return 'absent' if m == 'absent' else 'hidden' if m is None else "
    "'deferred' if L.is_deferred(m) else 'loaded'\n"
)


def _run(code: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _STATE + code], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_text_path_leaves_media_and_solvers_unloaded_and_triton_hidden():
    result = _run(
        "from vllm import LLM\n"
        "try:\n"
        "    import triton; triton_error = ''\n"
        "except ImportError as e:\n"
        "    triton_error = type(e).__name__\n"
        "print(json.dumps({'states': {n: state(n) for n in %r}, 'triton': state('triton'),"
        " 'triton_error': triton_error, 'triton_spec': importlib.util.find_spec('triton') is None}))\n"
        % (DEFERRED_ON_TEXT_PATH,),
        VLLM_OMNI_EDGE_LAZY_IMPORTS="1",
    )
    assert result["states"] == {n: "deferred" for n in DEFERRED_ON_TEXT_PATH}
    assert lazy_imports.torch_is_cpu_only()  # this venv's torch is the +cpu wheel
    assert result["triton"] == "hidden" and result["triton_error"] == "ModuleNotFoundError"
    assert result["triton_spec"]


def test_deferred_packages_load_and_work_on_first_use():
    result = _run(
        "import numpy as np\n"
        "from vllm import LLM\n"
        "from vllm.multimodal import audio, video\n"
        "from transformers.loss import loss_for_object_detection as det\n"
        "x = np.sin(np.arange(1600) / 1600 * 2 * np.pi * 5).astype(np.float32)\n"
        "half = audio.scipy_signal.resample_poly(x, 1, 2)\n"
        "img = video.cv2.resize(np.full((8, 8, 3), 7, np.uint8), (4, 2))\n"
        "frame = audio.av.AudioFrame(format='s16', layout='mono', samples=16)\n"
        "rows, cols = det.linear_sum_assignment(np.array([[4, 1, 3], [2, 0, 5], [3, 2, 2]]))\n"
        "import scipy, scipy.signal, av, cv2\n"
        "print(json.dumps({'states': {n: state(n) for n in %r},"
        " 'half_len': len(half), 'half_err': float(abs(half[100:-100] - x[::2][100:-100]).max()),"
        " 'img': [list(img.shape), int(img.min()), int(img.max())], 'samples': frame.samples,"
        " 'assignment': [rows.tolist(), cols.tolist()],"
        " 'same_objects': scipy.signal is audio.scipy_signal and scipy.signal is scipy.__dict__['signal']"
        " and av is audio.av and cv2 is video.cv2}))\n" % (DEFERRED_ON_TEXT_PATH,),
        VLLM_OMNI_EDGE_LAZY_IMPORTS="1",
    )
    assert result["states"] == {n: "loaded" for n in DEFERRED_ON_TEXT_PATH}
    assert result["half_len"] == 800 and result["half_err"] < 1e-3
    assert result["img"] == [[2, 4, 3], 7, 7]
    assert result["samples"] == 16
    assert result["assignment"] == [[0, 1, 2], [1, 0, 2]]  # the optimum: cost 1 + 2 + 2
    assert result["same_objects"]


def test_flag_off_imports_everything_as_vllm_does():
    result = _run(
        "from vllm import LLM\n"
        "print(json.dumps({'states': {n: state(n) for n in %r + ('triton',)},"
        " 'finder': any(type(f).__module__ == L.__name__ for f in sys.meta_path)}))\n"
        % (DEFERRED_ON_TEXT_PATH,),
        VLLM_OMNI_EDGE_LAZY_IMPORTS="0",
    )
    assert result["states"] == {n: "loaded" for n in DEFERRED_ON_TEXT_PATH + ("triton",)}
    assert not result["finder"]


def test_bad_flag_value_is_refused(monkeypatch):
    monkeypatch.setenv(lazy_imports.LAZY_IMPORTS_ENV, "yes")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_LAZY_IMPORTS=.yes.: expected 1"):
        lazy_imports.enabled()


# A package written to tmp_path, deferred in this process: what runs, and when.

@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    root = tmp_path / "edge_lazy_pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text(
        "import sys\n"
        "sys.edge_lazy_runs = getattr(sys, 'edge_lazy_runs', []) + [__name__]\n"
        "from . import helper\n"
        "VALUE = helper.twice(21)\n"
        "def call_me(x):\n"
        "    return x + 1\n"
    )
    (root / "helper.py").write_text(
        "import sys\n"
        "sys.edge_lazy_runs.append(__name__)\n"
        "def twice(x):\n"
        "    return 2 * x\n"
    )
    (root / "sub" / "__init__.py").write_text(
        "import sys\n"
        "sys.edge_lazy_runs.append(__name__)\n"
        "import edge_lazy_pkg\n"
        "PARENT_VALUE = edge_lazy_pkg.VALUE\n"
    )
    (root / "broken.py").write_text("raise RuntimeError('broken body')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(lazy_imports.DEFERRED, "edge_lazy_pkg", "a test package")
    monkeypatch.setitem(lazy_imports.DEFERRED, "edge_lazy_pkg.broken", "a test module")
    monkeypatch.setitem(lazy_imports.DEFERRED_CALLABLES, "edge_lazy_pkg", frozenset({"call_me"}))
    if lazy_imports._finder not in sys.meta_path:
        monkeypatch.setattr(sys, "meta_path", [lazy_imports._finder, *sys.meta_path])
    monkeypatch.setattr(sys, "edge_lazy_runs", [], raising=False)
    yield
    for name in [n for n in sys.modules if n == "edge_lazy_pkg" or n.startswith("edge_lazy_pkg.")]:
        del sys.modules[name]


def test_body_runs_on_first_attribute_only(fake_package):
    import edge_lazy_pkg

    assert lazy_imports.is_deferred(edge_lazy_pkg) and sys.edge_lazy_runs == []
    import edge_lazy_pkg as again  # a second import does not run it either

    assert again is edge_lazy_pkg and sys.edge_lazy_runs == []
    assert edge_lazy_pkg.VALUE == 42
    assert sys.edge_lazy_runs == ["edge_lazy_pkg", "edge_lazy_pkg.helper"]
    assert type(edge_lazy_pkg) is type(sys) and sys.modules["edge_lazy_pkg"] is edge_lazy_pkg


def test_submodule_waits_with_its_package_and_loads_it_first(fake_package):
    import edge_lazy_pkg.sub as sub

    assert lazy_imports.is_deferred(sub) and sys.edge_lazy_runs == []
    assert sub.PARENT_VALUE == 42
    assert sys.edge_lazy_runs == ["edge_lazy_pkg", "edge_lazy_pkg.helper", "edge_lazy_pkg.sub"]


def test_declared_callable_loads_on_call_not_on_from_import(fake_package):
    from edge_lazy_pkg import call_me

    assert sys.edge_lazy_runs == []
    assert call_me(1) == 2 and sys.edge_lazy_runs[0] == "edge_lazy_pkg"


def test_a_failing_body_raises_at_first_use_and_is_retried(fake_package):
    import edge_lazy_pkg.broken as broken

    with pytest.raises(RuntimeError, match="broken body"):
        broken.anything
    assert "edge_lazy_pkg.broken" not in sys.modules
    with pytest.raises(RuntimeError, match="broken body"):
        importlib.import_module("edge_lazy_pkg.broken").anything


def test_threads_run_the_body_once(fake_package):
    import edge_lazy_pkg

    values = []
    threads = [threading.Thread(target=lambda: values.append(edge_lazy_pkg.VALUE)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert values == [42] * 8 and sys.edge_lazy_runs.count("edge_lazy_pkg") == 1


def test_install_is_idempotent():
    lazy_imports.install()  # the .pth may already have run it
    assert lazy_imports.install() == "hook already installed"
    assert sum(f is lazy_imports._finder for f in sys.meta_path) <= 1


def test_a_watched_deferred_module_does_not_loop_between_finders(fake_package, monkeypatch):
    from vllm_omni_edge.patches import import_hook

    seen = []
    monkeypatch.setattr(import_hook, "_callbacks", {})
    import_hook.when_imported("edge_lazy_pkg", lambda module: seen.append(module.VALUE))
    import edge_lazy_pkg

    assert edge_lazy_pkg.VALUE == 42 and seen == [42]


def test_vllm_audio_resamplers_run_on_their_deferred_backends():
    result = _run(
        "import numpy as np\n"
        "from vllm import LLM\n"
        "from vllm.multimodal.audio import AudioResampler\n"
        "x = np.sin(np.arange(22050) / 22050 * 2 * np.pi * 440).astype(np.float32)\n"
        "before = {n: state(n) for n in ('av', 'scipy.signal')}\n"
        "a = AudioResampler(target_sr=16000, method='pyav').resample(x, orig_sr=22050)\n"
        "b = AudioResampler(target_sr=16000, method='scipy').resample(x, orig_sr=22050)\n"
        "t = np.arange(16000) / 16000\n"
        "ref = np.sin(2 * np.pi * 440 * t)\n"
        "print(json.dumps({'before': before, 'after': {n: state(n) for n in ('av', 'scipy.signal')},"
        " 'lens': [len(a), len(b)], 'err_av': float(abs(a[200:-200] - ref[200:-200]).max()),"
        " 'err_scipy': float(abs(b[200:-200] - ref[200:-200]).max())}))\n",
        VLLM_OMNI_EDGE_LAZY_IMPORTS="1",
    )
    assert result["before"] == {"av": "deferred", "scipy.signal": "deferred"}
    assert result["after"] == {"av": "loaded", "scipy.signal": "loaded"}
    assert result["lens"] == [16000, 16000]
    assert result["err_scipy"] < 1e-2 and result["err_av"] < 5e-2, result
