"""The tiny CPU demo. Until the RL loop lands, it runs the most complete path that works end to
end: build the tiny policy offline, then roll it out on synthetic images and a video with vLLM
and write every response with its per-token logprobs."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from dataio.synth import colour_image, moving_ball_video
from models.tiny import tiny_model_dir
from yatt_mm.rollout.engine import EngineConfig, Request, RolloutEngine, SamplingConfig


def _request(sample) -> Request:
    media = {"type": "image"} if sample.image is not None else {"type": "video"}
    return Request(
        messages=[{"role": "user", "content": [media, {"type": "text", "text": sample.question}]}],
        images=[sample.image] if sample.image is not None else [],
        videos=[sample.video] if sample.video is not None else [],
    )


def run_demo(run_dir: str | None = None, n: int = 4, max_tokens: int = 24) -> int:
    out = Path(run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print("yatt-mm demo: the RL loop is not built yet; this runs the rollout stage on CPU.")

    t0 = time.perf_counter()
    model = tiny_model_dir("policy", seed=0)
    print(f"[1/3] tiny policy ready in {time.perf_counter() - t0:.1f}s: {model}")

    engine = RolloutEngine(EngineConfig(model=str(model)))
    print(f"[2/3] vLLM engine up in {engine.startup_seconds:.1f}s")

    rng = random.Random(0)
    samples = [colour_image(rng) for _ in range(4)] + [moving_ball_video(rng) for _ in range(2)]
    result = engine.generate([_request(s) for s in samples], SamplingConfig(n=n, max_tokens=max_tokens))
    print(
        f"[3/3] {len(samples)} prompts x {n} responses: {result.generated_tokens} tokens in "
        f"{result.seconds:.2f}s ({result.tokens_per_s:.0f} tok/s)"
    )

    with open(out / "rollout.jsonl", "w") as f:
        for sample, group in zip(samples, result.responses):
            kind = "image" if sample.image is not None else "video"
            for r in group:
                f.write(json.dumps({
                    "media": kind, "question": sample.question, "answer": sample.answer,
                    "response": r.text, "token_ids": r.token_ids, "logprobs": r.logprobs,
                    "finish_reason": r.finish_reason,
                }) + "\n")
            print(f"  {kind:5s} {sample.question!r} (answer {sample.answer}) -> {group[0].text[:40]!r}")
    print(f"responses and logprobs written to {out / 'rollout.jsonl'}")
    return 0
