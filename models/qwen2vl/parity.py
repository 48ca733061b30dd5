"""Megatron Qwen2-VL / Qwen2.5-VL vs transformers on the same weights and inputs: logits side by side.

`yatt-mm model parity HF_DIR [--tp T] [--pp P] [--pipeline-layers 1,2]` runs this (under
torchrun on T x P ranks when that is > 1; `--pipeline-layers`: language layers per stage).
Built-in probes: text only, one image, two images, one video. Under pipeline parallelism the probes go through Megatron's schedule stage by stage and the logits are compared
where they are, on the last stage. The last line printed is one JSON object with the max abs
logit difference per probe.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from models.comm import init_parallel


def probes(seed: int = 0) -> dict[str, tuple[list, dict]]:
    """(chat messages, processor media kwargs) per probe; media are random but fixed."""
    rng = np.random.default_rng(seed)
    img = lambda h, w: Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))  # noqa: E731
    video = rng.integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    q = {"type": "text", "text": "What colour is the square? Answer: red"}
    return {
        "text": ([{"role": "user", "content": [q]}], {}),
        "image": ([{"role": "user", "content": [{"type": "image"}, q]}], {"images": [img(90, 120)]}),
        "multi_image": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, q]}],
                        {"images": [img(64, 64), img(112, 84)]}),
        "video": ([{"role": "user", "content": [{"type": "video"}, q]}], {"videos": [video]}),
    }


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def run_parity(hf_dir: str, tp: int = 1, pp: int = 1, layers: tuple[int, ...] = ()) -> dict[str, float]:
    import models  # noqa: F401 - CPU runtime hooks
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    from models.qwen2vl.config import Qwen2VLSpec
    from models.qwen2vl.convert import load_hf_into
    from models.qwen2vl.model import Qwen2VLModel

    groups = init_parallel(tp, seed=0, pipeline_parallel=pp)  # torchrun's ranks, or one local process
    spec = Qwen2VLSpec.from_hf_dir(hf_dir)
    model = Qwen2VLModel(spec, torch.float32, tp, pp=pp, layers=layers).eval()
    load_hf_into(model, hf_dir, groups.tp_rank, tp)
    hf_cls = Qwen2_5_VLForConditionalGeneration if spec.is_qwen25 else Qwen2VLForConditionalGeneration
    hf = hf_cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)

    return logit_diffs(model, hf, processor, spec, groups)


def logit_diffs(model, hf, processor, spec, groups, media_kwargs=lambda media: media) -> dict[str, float]:
    """The max abs logit difference per probe between transformers' `hf` and the Megatron `model`
    (through the pipeline schedule; the logits are compared on the last stage) on the same
    processor batch; `media_kwargs`: a probe's media kwargs -> the processor's."""
    from models.inputs import VLMInputs
    from models.trainer import MicroBatch, Pipeline, forward_only

    result = {}
    for name, (messages, media) in probes().items():
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = processor(text=[text], return_tensors="pt", **media_kwargs(media))
        with torch.no_grad():
            ref = hf(**batch).logits.float()
        inputs = VLMInputs.from_processor(spec, dict(batch))
        (out,) = forward_only(model, [MicroBatch(inputs)], lambda m, mb: stage_logits(m, mb.inputs),
                              Pipeline.of(groups))
        result[name] = float((ref - out["logits"].float()).abs().max())
    return result


def stage_logits(model, inputs):
    """The whole vocabulary's logits on the last stage; the hidden states on the others."""
    if not model.pre_process:
        inputs = inputs.text_only()
    out = model(inputs)
    return {"logits": gather_vocab(out)} if model.post_process else out


def parse_layers(text: str) -> tuple[int, ...]:
    """"1,2" -> (1, 2): `--pipeline-layers`."""
    try:
        return tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer counts, e.g. 1,2") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pipeline-layers", type=parse_layers, default=(),
                        help="language layers per stage, comma-separated (default: an even split)")
    args = parser.parse_args(argv)
    result = run_parity(args.hf_dir, args.tp, args.pp, args.pipeline_layers)
    if dist.get_rank() == 0:
        for name, diff in result.items():
            print(f"{name:12s} max |logits diff| = {diff:.3e}")
        print(json.dumps({"tp": args.tp, "pp": args.pp, "pipeline_layers": list(args.pipeline_layers),
                          "max_abs_diff": result}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
