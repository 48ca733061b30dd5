"""GenRM throughput: judged responses per second, in-process vLLM engine vs a vLLM
OpenAI-compatible server process (async client, all requests in flight), same judge model
(the tiny policy as a stand-in judge: throughput does not depend on its verdicts), same items.

Last line: JSON with inprocess_per_s, server_per_s, and the server's start-up seconds.
"""

from __future__ import annotations

import json
import random
import time

import models  # noqa: F401
from _common import full_or_smoke


def main(items_n: int = full_or_smoke(64, 8)) -> None:
    from dataio.synth import colour_image
    from models.tiny import tiny_model_dir
    from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig, JudgeItem, ServerJudge
    from yatt_mm.engines.server import JudgeServer

    rng = random.Random(0)
    samples = [colour_image(rng) for _ in range(items_n)]
    items = [JudgeItem(s.question, rng.choice(["red", "blue", "green", "yellow"]), s.answer, images=[s.image])
             for s in samples]
    cfg = JudgeConfig(model=str(tiny_model_dir("policy")), votes=2, max_tokens=8)

    judge = InProcessJudge(cfg)
    judge.score(items[:4])  # warm-up
    start = time.perf_counter()
    judge.score(items)
    inproc = items_n / (time.perf_counter() - start)
    judge.engine.shutdown()

    with JudgeServer(JudgeConfig(**{**vars(cfg), "backend": "server"})) as server:
        client = ServerJudge(cfg, server.base_url, server.model_name)
        client.score(items[:4])
        start = time.perf_counter()
        results = client.score(items)
        served = items_n / (time.perf_counter() - start)
        startup = server.startup_seconds
    fallbacks = sum(r.failure == "unreachable" for r in results)
    print(f"{items_n} responses x {cfg.votes} votes: in-process {inproc:.1f}/s, server {served:.1f}/s "
          f"(server start-up {startup:.1f}s, {fallbacks} unreachable)")
    print(json.dumps({"inprocess_per_s": round(inproc, 2), "server_per_s": round(served, 2),
                      "server_startup_s": round(startup, 1)}))


if __name__ == "__main__":
    main()
