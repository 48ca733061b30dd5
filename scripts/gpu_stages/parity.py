"""parity (and the family stages): Megatron's logits vs transformers' on the same weights and
inputs, fp32 with TF32 off and bf16, each against its own tolerance; every parameter in the
model's dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_stages.common import free, params_m
from gpu_stages.report import TINY_KIND


# Parity is judged on max |logit difference| / max |reference logit| (bf16's error grows with the
# logits' size, and random 2B-width logits reach several units):
# - fp32: both sides in IEEE fp32 differ only in summation order (~1e-6 relative; the --cpu run
#   measures ~1e-6). 1e-4 sits well above that and well below TF32's 10-bit mantissa (~5e-4
#   relative a matmul): a reference silently running in TF32 fails instead of passing.
# - bf16: 8 mantissa bits, ~4e-3 relative rounding at every op, compounded over the layers and
#   rounded at different points by the two implementations (fused kernels, softmax precision).
#   5e-2 is ~12 bf16 steps of the largest logit (--cpu measures 8e-3 for Qwen2-VL, 1.1e-2 for
#   Qwen3-VL); a wrong weight or position moves logits by O(1).
# - bf16, mixture of experts: also a token whose top-2 router scores are within bf16's rounding
#   can go to another expert on one side (--cpu measures 3.7e-2 on the tiny Qwen3-VL-MoE), so
#   0.2; a broken expert layout or router still moves logits by O(1).
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "bf16_moe": 0.2}


def parity_stage(hf_dir: str, device: torch.device, moe: bool = False) -> dict:
    """fp32 with TF32 off for matmuls and cuDNN (transformers' patch embedding is a Conv3d, which
    cuDNN runs in TF32 by default on Hopper: the reference itself would be off by ~1e-3), then
    bf16; the TF32 settings are restored after and recorded as they were during the comparison."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        out = {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
               # the same settings as torch's newer API reads them ("ieee", or "none": no TF32 either)
               "fp32_precision": {"matmul": getattr(torch.backends.cuda.matmul, "fp32_precision", None),
                                  "cudnn_conv": getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision",
                                                        None)}}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            diff, scale, dtypes = parity(hf_dir, device, dtype)
            out[name] = {"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / scale,
                         "tolerance_rel": PARITY_TOLERANCE[name + ("_moe" if moe and name == "bf16" else "")],
                         "param_dtypes": dtypes}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    out["checks"] = {f"parity_{n}": out[n]["rel"] < out[n]["tolerance_rel"] for n in ("fp32", "bf16")}
    # every parameter in the model's dtype: CUDA's layer_norm refuses a bf16 input with a float32
    # weight (the first GPU run's error; the CPU's accepts it), so a norm left in float32 fails here
    out["checks"] |= {f"params_{n}": out[n]["param_dtypes"] == [str(d)] for n, d in
                      (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    return out


def parity(hf_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[float, float, list[str]]:
    """(max |logit difference|, max |reference logit|, our model's parameter dtypes) of Megatron
    vs transformers over the built-in probes (text, image, two images, video), both in `dtype` on
    `device`; any family (a family with timed videos gets their metadata, as its own parity does)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from models.family import family_for_dir, read_spec
    from models.inputs import VLMInputs
    from models.qwen2vl.parity import probes
    from models.qwen3vl.parity import with_video_metadata

    family, spec = family_for_dir(hf_dir), read_spec(hf_dir)
    ours = family.build_model(spec, dtype, 1).to(device).eval()
    family.load_hf_into(ours, hf_dir, 0, 1)
    dtypes = sorted({str(p.dtype) for p in ours.parameters()})
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    timed = spec.model_type in family.timed_video_types
    worst = scale = 0.0
    for messages, media in probes().values():
        batch = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                          return_tensors="pt", **(with_video_metadata(media) if timed else media))
        with torch.no_grad():
            ref = hf(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}).logits.float()
            got = ours(VLMInputs.from_processor(spec, dict(batch)).to(device)).float()
        worst = max(worst, float((ref - got).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    del ours, hf
    free(device)
    return worst, scale, dtypes


def family_parity_stage(kind: str, cpu: bool, device: torch.device, tmp: Path) -> dict:
    """Parity of another family's model: the tiny one (models/<family>/tiny.py through
    models/tiny.py's cache) under --cpu; on a GPU Qwen3-VL at Qwen3-VL-8B's widths with 2 layers
    (its builder's REAL_8B_WIDTHS), the others at their tiny sizes."""
    from models.tiny import tiny_model_dir

    if kind == "qwen3vl" and not cpu:
        from models.qwen3vl.tiny import REAL_8B_WIDTHS, make_tiny

        hf_dir = str(tmp / "qwen3vl-8b-widths")
        make_tiny(hf_dir, widths=REAL_8B_WIDTHS)
    else:
        hf_dir = str(tiny_model_dir(TINY_KIND[kind]))
    out = {"model": Path(hf_dir).name, "params_m": params_m(hf_dir)}
    out |= parity_stage(hf_dir, device, moe=kind.endswith("_moe"))
    return out
