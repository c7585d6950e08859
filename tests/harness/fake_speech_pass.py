"""pass_speech with a fake engine: answers each clip's reference text (one word misheard in "fox"),
or fails the clip named by FAKE_SPEECH_FAIL_CLIP. Same contract as the real pass."""

from __future__ import annotations

import os
import sys
import time

from vllm_omni_edge_bench.harness import pass_speech, speech
from vllm_omni_edge_bench.harness.pass_common import pass_main

MISHEARD = {"fox": "The quick brown fox jump over the lazy dog."}


class FakeEngine:
    role = "fake_speech"

    def __init__(self, spec):
        fixtures = next(w["fixtures"] for w in spec["workloads"] if w["kind"] == "speech")
        self.by_frames = {round(c.duration_s * speech.SAMPLE_RATE): c for c in speech.load_clips(fixtures)}
        self.fail = os.environ.get("FAKE_SPEECH_FAIL_CLIP")

    def transcribe(self, audio) -> str:
        clip = self.by_frames[len(audio)]
        time.sleep(0.01)
        if clip.key == self.fail:
            raise RuntimeError(f"cannot hear {clip.key}")
        return MISHEARD.get(clip.key, clip.reference)

    def evidence(self):
        return {"engine": "fake", "model_path": "none"}


def main(argv=None) -> int:
    return pass_main(lambda spec: pass_speech.run_pass(spec, engine_factory=lambda s, _dir: FakeEngine(s)),
                     "fake speech pass", argv)


if __name__ == "__main__":
    sys.exit(main())
