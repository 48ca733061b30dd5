"""Megatron Qwen3.5-MoE vs transformers on the same weights and inputs: logits side by side.

`python -m models.qwen35_moe.parity HF_DIR [--tp T] [--pp P] [--ep E]` (under torchrun for
T x P x DP ranks > 1; `yatt-mm model parity` launches it). Qwen3-VL-MoE's comparison
(models/qwen3vl_moe/parity.py: text, one image, two images, a video, the HF export, the worst
over every rank, experts spread over E ranks) and, at EP 1 without a pipeline, Qwen3.5's
"packed" probe (models/qwen35/parity.py: padded rows against the same samples packed into one,
so a DeltaNet state leaking across a sample boundary shows).
"""

from __future__ import annotations

from models.qwen3vl_moe import parity as moe


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, layers=()) -> dict[str, float]:
    result = moe.run_parity(hf_dir, tp, pp, ep, layers)
    if pp == 1 and ep == 1:  # the packed probe builds its model without expert parallelism
        from models.qwen35.parity import packed_vs_padded

        result["packed"] = packed_vs_padded(hf_dir, tp)
    return result


def main(argv: list[str] | None = None) -> int:
    return moe.main(argv, run_parity)


if __name__ == "__main__":
    raise SystemExit(main())
