"""Rollout layer overhead: yatt-mm's RolloutEngine.generate vs raw vLLM LLM.generate on the same
engine, prompts and media (tiny policy, 16 image + 8 video prompts, n=4, 32 tokens).

The layer adds chat formatting, media packing and conversion of vLLM's outputs to plain
responses with per-token logprobs. Interleaved rounds, best of each reported.

Also the cost of seeded sampling (rollout.sampling.seed: every prompt's requests with a seed of
their own, which vLLM samples through per-request generators), on the same engine and prompts.

Last line: JSON with overhead (1 - ours/raw tokens/s; target below 0.10), seeded_overhead
(1 - seeded/ours tokens/s), and the three rates.
"""

from __future__ import annotations

import json
import random
import time

import models  # noqa: F401
from _common import full_or_smoke

IMAGE_PROMPTS, VIDEO_PROMPTS = full_or_smoke((16, 8), (2, 1))
N, MAX_TOKENS = full_or_smoke((4, 32), (2, 8))


def main(rounds: int = full_or_smoke(5, 1)) -> None:
    from vllm import SamplingParams

    from dataio.synth import colour_image, moving_ball_video
    from models.tiny import tiny_model_dir
    from yatt_mm.rl.samples import Prompt
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine, SamplingConfig

    engine = RolloutEngine(EngineConfig(model=str(tiny_model_dir("policy"))))
    rng = random.Random(0)
    prompts = []
    for i in range(IMAGE_PROMPTS + VIDEO_PROMPTS):
        s = colour_image(rng) if i < IMAGE_PROMPTS else moving_ball_video(rng)
        prompts.append(Prompt(f"k{i}", s.question, s.answer, [s.image] if s.image else [],
                              [s.video] if s.video is not None else []))
    sampling = SamplingConfig(n=N, max_tokens=MAX_TOKENS, temperature=1.0)
    params = SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0)  # what generate() asks for
    raw_inputs = [engine._vllm_input(p.request()) for p in prompts]  # prepared outside the timing

    def ours() -> float:
        start = time.perf_counter()
        result = engine.generate([p.request() for p in prompts], sampling)
        return result.generated_tokens / (time.perf_counter() - start)

    def seeded() -> float:  # rollout.sampling.seed set: each prompt seeded from its draw
        start = time.perf_counter()
        result = engine.generate([p.request(p.sampling_seed(0)) for p in prompts], sampling)
        return result.generated_tokens / (time.perf_counter() - start)

    def raw() -> float:
        start = time.perf_counter()
        outs = engine.llm.generate(raw_inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - start)

    raw(), ours(), seeded()  # warm-up: encoder cache, allocator
    ours_rates, raw_rates, seeded_rates = [], [], []
    for _ in range(rounds):
        raw_rates.append(raw())
        ours_rates.append(ours())
        seeded_rates.append(seeded())
    best_ours, best_raw, best_seeded = max(ours_rates), max(raw_rates), max(seeded_rates)
    overhead = 1.0 - best_ours / best_raw
    print(f"rollout layer {best_ours:.0f} tok/s vs raw vLLM {best_raw:.0f} tok/s; seeded {best_seeded:.0f} tok/s "
          f"(best of {rounds} interleaved rounds)")
    print(json.dumps({"overhead": round(overhead, 4), "seeded_overhead": round(1.0 - best_seeded / best_ours, 4),
                      "tokens_per_s": round(best_ours, 1), "seeded_tokens_per_s": round(best_seeded, 1),
                      "raw_vllm_tokens_per_s": round(best_raw, 1)}))


if __name__ == "__main__":
    main()
