"""Run a tiny omni pipeline through vLLM-Omni's ``Omni`` in this process; print one JSON line.

A script (not an in-test call) because ``Omni`` spawns stage processes that re-import
``__main__``; run as ``python -m tests.omni.omni_probe MODEL DEPLOY_YAML OUT_WAV``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model, deploy, out_wav = sys.argv[1:4]
    import soundfile as sf
    import torch
    from vllm import SamplingParams

    from vllm_omni import Omni

    t0 = time.monotonic()
    omni = Omni(model=model, deploy_config=deploy, stage_init_timeout=900, init_timeout=1200)
    init_s = time.monotonic() - t0
    prompt = (
        "<|im_start|>system\nYou are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, "
        "capable of perceiving auditory and visual inputs, as well as generating text and speech.<|im_end|>\n"
        "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    )
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),  # thinker
        # The talker's forward rewrites sampling_metadata.prompt_token_ids, which vLLM only
        # builds when a penalty is set: keep the deploy YAML's repetition_penalty.
        SamplingParams(max_tokens=48, temperature=0.9, top_k=40, seed=1, repetition_penalty=1.05),  # talker
        SamplingParams(max_tokens=64),  # code2wav
    ]
    result = {"init_s": init_s, "text": None, "audio_samples": 0, "sample_rate": None}
    for out in omni.generate([{"prompt": prompt}], params):
        if out.final_output_type == "text":
            result["text"] = out.outputs[0].text
            result["text_token_ids"] = list(out.outputs[0].token_ids)
        elif out.final_output_type == "audio":
            mm = out.multimodal_output or {}
            audio = mm.get("audio")
            if isinstance(audio, (list, tuple)):  # chunks, as serving_chat.py concatenates them
                audio = torch.cat([torch.as_tensor(a).reshape(-1) for a in audio])
            audio = torch.as_tensor(audio).detach().float().reshape(-1).numpy()
            sr = mm.get("sr", 24000)
            rate = int(sr.item() if hasattr(sr, "item") else sr)
            sf.write(out_wav, audio, rate, format="WAV")
            result["audio_samples"] = int(audio.size)
            result["sample_rate"] = rate
    result["total_s"] = time.monotonic() - t0
    omni.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
