"""Generate one image through vLLM-Omni's ``Omni`` (diffusion stage); write the PNG and ``<OUT_PNG>.json``.

A script (not an in-test call) because ``Omni`` may spawn stage processes, which re-import
``__main__``; run as ``python -m tests.omni.omni_image_probe MODEL OUT_PNG WIDTH HEIGHT``.
The result goes to a file, not stdout: vLLM-Omni runs a lone diffusion stage in this
process and decorates its stdout with a ``(DiffusionWorker pid=...)`` prefix.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    model, out_png, width, height = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    t0 = time.monotonic()
    # Eager: on CPU a compiled diffusion transformer costs minutes of inductor start-up.
    omni = Omni(model=model, enforce_eager=True, stage_init_timeout=900, init_timeout=1200)
    init_s = time.monotonic() - t0
    params = OmniDiffusionSamplingParams(
        width=width, height=height, num_inference_steps=2, guidance_scale=2.0, seed=0
    )
    result = {"init_s": init_s, "images": 0}
    for out in omni.generate([{"prompt": "a red square on a blue field"}], params):
        if out.images:
            image = out.images[0]
            image.save(out_png, format="PNG")
            result.update(images=len(out.images), final_output_type=out.final_output_type, size=list(image.size))
    result["total_s"] = time.monotonic() - t0
    omni.close()
    Path(out_png + ".json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
