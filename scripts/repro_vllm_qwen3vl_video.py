"""Minimal reproduction: vLLM 0.32 normalises a Qwen3-VL video with the *image* processor's
mean/std (device-side normalisation, `mm_device_do_normalize`), where transformers uses the
video processor's. A checkpoint whose two processors normalise differently then gets other video
embeddings in vLLM than in transformers, and video logprobs 0.1-0.5 apart; images agree.

    .venv/bin/python scripts/repro_vllm_qwen3vl_video.py [MODEL_DIR] [--as-yatt-mm]

MODEL_DIR defaults to the tiny random Qwen3-VL (models/qwen3vl/tiny.py) copied to a temporary
folder with its image processor's mean/std set to CLIP's (0.481.../0.268..., the defaults of
transformers' Qwen2VLImageProcessor; the video processor keeps 0.5/0.5): the processors of the
tiny model before its version 2, and of any checkpoint saved with the default image processor.
Released Qwen3-VL checkpoints use 0.5/0.5 for both and are not affected.

For the same prompt, frames and metadata it prints the vision embeddings' max difference and the
max |logprob| gap of 8 sampled tokens (vLLM vs transformers, fp32), for an image and a video,
without and with yatt-mm's workaround (yatt_mm/engines/vllm_fixes.py: `mm_device_do_normalize=False`,
so the HF processors normalise each modality on the host). The last line is one JSON object.
`--as-yatt-mm` runs one engine only, with the settings yatt-mm's engine gives this checkpoint
(`engine_fixes`): a check that a model directory (e.g. a run's export) answers in vLLM as in
transformers.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402,F401 - CPU runtime hooks (torchvision) before transformers/vLLM
from models import runtime  # noqa: E402

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
FPS = 2.0


def mismatched_tiny(out: Path) -> Path:
    """The tiny Qwen3-VL with CLIP's normalisation for images, 0.5/0.5 for videos."""
    from models.tiny import tiny_model_dir

    shutil.copytree(tiny_model_dir("qwen3vl"), out)
    config = json.loads((out / "processor_config.json").read_text())
    config["image_processor"].update(image_mean=CLIP_MEAN, image_std=CLIP_STD)
    (out / "processor_config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> int:
    runtime.set_vllm_cpu_defaults()  # in-process, eager vLLM on CPU (docs: /work/shared/RUNTIME.md)
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams

    from yatt_mm.engines.vllm_fixes import engine_fixes

    tmp = Path(tempfile.mkdtemp(prefix="repro-q3vl-"))
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model_dir = Path(args[0]) if args else mismatched_tiny(tmp / "model")
    proc = AutoProcessor.from_pretrained(model_dir)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8))
    video = rng.integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    meta = {"fps": FPS, "total_num_frames": 4, "duration": 4 / FPS, "frames_indices": [0, 1, 2, 3]}

    def prompt(kind):
        return proc.apply_chat_template([{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "What?"}]}],
                                        add_generation_prompt=True, tokenize=False)

    cases = {  # name -> (HF processor kwargs, vLLM multi_modal_data)
        "image": (dict(text=[prompt("image")], images=[image]), {"image": image}),
        "video": (dict(text=[prompt("video")], videos=[video], video_metadata=[meta], do_sample_frames=False),
                  {"video": (video, {**meta, "do_sample_frames": False})}),
    }

    def hf_gap(enc, out) -> float:
        """Teacher-forced transformers logprobs of vLLM's sampled tokens vs vLLM's own."""
        gen = list(out.outputs[0].token_ids)
        theirs = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)]
        assert list(out.prompt_token_ids) == enc["input_ids"][0].tolist(), "prompt ids differ"
        ids = torch.tensor([list(out.prompt_token_ids) + gen])
        types = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(gen), dtype=torch.long)], 1)
        media = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **media).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        p = len(out.prompt_token_ids)
        return max(abs(lp[p - 1 + i, t].item() - v) for i, (t, v) in enumerate(zip(gen, theirs)))

    def vision_diff(captured, enc, kind) -> float:
        """vLLM's vision tower output (main merger, captured in its forward) vs transformers'."""
        pixels, grid = ((enc["pixel_values"], enc["image_grid_thw"]) if kind == "image"
                        else (enc["pixel_values_videos"], enc["video_grid_thw"]))
        with torch.no_grad():
            ours = hf.model.get_image_features(pixels, grid).pooler_output[0]
        return float((captured["out"][:, : ours.shape[1]] - ours).abs().max())

    def capture_vision(llm) -> dict:
        captured = {}
        model = llm.apply_model(lambda m: m)[0]  # in-process engine: the model object itself
        forward = model.visual.forward

        def capture(x, grid_thw, **kw):
            captured["out"] = out = forward(x, grid_thw, **kw)
            return out

        model.visual.forward = capture
        return captured

    enc_prompt = {k: v[0]["text"][0] for k, v in cases.items()}
    encs = {k: proc(return_tensors="pt", **kw) for k, (kw, _) in cases.items()}
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, logprobs=0, ignore_eos=True)
    result: dict = {"model": str(model_dir), "fix_kwargs": engine_fixes(model_dir)}
    engines = ((("as_yatt_mm", engine_fixes(model_dir)),) if "--as-yatt-mm" in sys.argv else
               (("without_fix", {}), ("with_fix", {"mm_device_do_normalize": False})))
    for label, extra in engines:
        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  distributed_executor_backend="uni", limit_mm_per_prompt={"image": 1, "video": 1}, **extra)
        captured = capture_vision(llm)
        for kind in cases:
            out = llm.generate([{"prompt": enc_prompt[kind], "multi_modal_data": cases[kind][1]}], params,
                               use_tqdm=False)[0]
            gap, vis = hf_gap(encs[kind], out), vision_diff(captured, encs[kind], kind)
            result[f"{label}_{kind}_gap"], result[f"{label}_{kind}_vision_diff"] = gap, vis
            print(f"{label:12s} {kind:6s}: max |logprob vLLM - transformers| {gap:.2e}, vision embeddings {vis:.2e}")
        del llm
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
