"""Megatron Qwen3.5 vs transformers on the same weights and inputs: logits side by side, plus
packed rows against padded ones.

`yatt-mm model parity HF_DIR [--tp T] [--pp P]` runs this through the family. The probes, the
export check and the TP-order comparison are Qwen3-VL's (models/qwen3vl/parity.py: text, one
image, two images, a video with timestamps; "tp_order/" at TP > 1). Added here, without a
pipeline: "packed", the largest logit difference between a right-padded batch of three samples
(text, image, video, of different lengths) and the same samples packed into one row
(models/packing.py). The DeltaNet layers carry a recurrent state and a conv history along the
sequence; packed, each sample must start from zero as it does alone, so a state that leaks
across a sample boundary shows here (attention alone would not: it is masked per sample).
"""

from __future__ import annotations

import torch

from models.qwen2vl.parity import gather_vocab, probes
from models.qwen3vl import parity as qwen3vl


def packed_vs_padded(hf_dir: str, tp: int) -> float:
    """Max abs logit difference, over every real token, between three samples run right-padded
    and run as one packed row, on a model built and loaded at `tp` (Megatron's groups made)."""
    from transformers import AutoProcessor

    from models.comm import comm
    from models.family import family_for_dir, read_spec
    from models.inputs import VLMInputs
    from models.packing import pack

    family, spec = family_for_dir(hf_dir), read_spec(hf_dir)
    model = family.build_model(spec, torch.float32, tp, "none", 1, ()).eval()
    family.load_hf_into(model, hf_dir, comm().tp_rank, tp)
    processor = AutoProcessor.from_pretrained(hf_dir)
    processor.tokenizer.padding_side = "right"
    samples = [probes()[name] for name in ("text", "image", "video")]
    texts = [processor.apply_chat_template(messages, add_generation_prompt=True) for messages, _ in samples]
    media = qwen3vl.with_video_metadata({"images": samples[1][1]["images"], "videos": samples[2][1]["videos"]})
    batch = processor(text=texts, return_tensors="pt", padding=True, **media)
    inputs = VLMInputs.from_processor(spec, dict(batch))
    row = pack(inputs)
    with torch.no_grad():
        padded = gather_vocab(model(inputs))
        packed = gather_vocab(model(row.inputs, packed_seq_params=row.params))
    return float((padded[row.rows, row.cols] - packed[0]).abs().max())


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, layers=()) -> dict[str, float]:
    """Qwen3-VL's comparison (models/qwen3vl/parity.py), and without a pipeline the packed probe."""
    result = qwen3vl.run_parity(hf_dir, tp, pp, 1, layers)
    if pp == 1:
        result["packed"] = packed_vs_padded(hf_dir, tp)
    return result


def main(argv: list[str] | None = None) -> int:
    return qwen3vl.main(argv, run_parity)


if __name__ == "__main__":
    raise SystemExit(main())
