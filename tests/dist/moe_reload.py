"""vLLM's in-place weight reload (the RL weight sync) on the tiny Qwen3-VL-MoE, with and without
yatt-mm's workaround (yatt_mm/engines/vllm_fixes.py `prepack_cpu_moe_weights_on_update`): the
engine reloads its own checkpoint, so its prompt logprobs must not move. Prints one JSON line:
the largest move without the workaround (vLLM's bug: > 0 while vLLM needs the workaround) and
with it, and whether the patch was in place."""

from __future__ import annotations

import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
import torch


def main() -> int:
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from dataio.synth import colour_image
    from models.tiny import tiny_model_dir
    from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine

    path = tiny_model_dir("qwen3vlmoe")
    engine = RolloutEngine(EngineConfig(model=str(path)))  # applies the workaround
    patched = UnquantizedFusedMoEMethod._setup_kernel
    img = colour_image(random.Random(0))
    request = Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": img.question}]}],
                      images=[img.image])
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def prompt_logprobs() -> torch.Tensor:
        out = engine.llm.generate([engine._vllm_input(request)], params, use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])

    checkpoint = load_file(str(path / "model.safetensors"))
    start = prompt_logprobs()
    result = {"patched": bool(getattr(patched, "_yatt_prepacks", False))}
    # vLLM as released: the experts' weights come back unpacked
    UnquantizedFusedMoEMethod._setup_kernel = getattr(patched, "__wrapped__", patched)
    engine.update_weights(checkpoint.items())
    result["without_fix"] = float((prompt_logprobs() - start).abs().max())
    UnquantizedFusedMoEMethod._setup_kernel = patched
    engine.update_weights(checkpoint.items())  # the same weights again, now prepacked
    result["with_fix"] = float((prompt_logprobs() - start).abs().max())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
