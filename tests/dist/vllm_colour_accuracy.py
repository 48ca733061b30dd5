"""Greedy vLLM accuracy of an HF model directory on fresh colour questions (a separate process:
the test session's own vLLM engine and Megatron must not share a process). Prints one JSON line."""

import json
import random
import sys

import models  # noqa: F401 - CPU runtime hooks first
from dataio.synth import colour_image
from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine, SamplingConfig

engine = RolloutEngine(EngineConfig(model=sys.argv[1]))
rng = random.Random(7)
samples = [colour_image(rng) for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 32)]
requests = [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}],
                    images=[s.image]) for s in samples]
result = engine.generate(requests, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
texts = [r[0].text for r in result.responses]
print(json.dumps({"accuracy": sum(t.strip() == s.answer for t, s in zip(texts, samples)) / len(samples),
                  "texts": texts[:8]}))
