"""Cached warm starts of the tiny models for the RL demo: a short SFT, run once per machine.

    from yatt_mm.demo.warmstart import warm_start
    policy_dir = warm_start("policy", "data/synth")   # HF directory (vLLM and transformers load it)
    judge_dir = warm_start("judge", "data/synth")

- policy: a WEAK start. 12 SFT steps on the true answers at lr 3e-4, stopped early: the tiny
  policy half learns the answer format and the colours (held-out accuracy about 0.45), and RL
  with the verifiable reward has the rest to gain. What matters is that sampling still says every
  colour word for every colour of image: a start of the same accuracy at lr 1e-3 never said
  'yellow', and RL, which can only reinforce what it samples, stalled at 3 of 4 colours. A
  format-only start (`random_answer`: one colour word drawn at random, chance accuracy) is kept
  as an option, but RL from it did not rise within 30 steps on the 2-core CPU at any learning
  rate we tried (2e-5 to 2e-4): the SFT on random answers teaches the policy to ignore the image.
- format_only: that start, as its own kind (12 steps, as `policy`): the student of on-policy
  distillation's learning test (docs/distillation.md), which the warm-started policy as teacher
  lifts where the reward alone does not.
- judge: a reference-guided GenRM. The tiny judge reads the prompt `yatt_mm.reward.genrm`
  builds (default template: media, question, reference answer, response) and learns to answer
  'Score: 1' / 'Score: 0' as the rule `exact_match(response, answer)` would. Two stages, because
  from a random start the tiny model does not find the two words to compare inside a long
  prompt (0.61 teacher-forced after 800 steps on the full prompt, 0.63 after 1600):
  1. `judge_compare`: text-only prompts holding just the reference and the response, true or
     wrong answers half each; the comparison is learnt suddenly after a plateau (600 to 1300
     steps seen here), so this stage stops once its held-out accuracy reaches 0.98;
  2. `judge`: the full prompt with the image, which it answers from the start (the attention it
     learnt finds the words by content), now with near misses among the responses (cut-off,
     doubled or run-together words, as an early policy writes them) so it learns where the rule
     draws its line.

The SFT runs in a child process (`python -m yatt_mm.sft.train`), so the caller's torch.distributed,
Megatron and vLLM state is untouched. The result is cached under
`cache_dir / f"{kind}-{hash}"`, the hash covering (kind, seed, steps, the data's fingerprint,
the tiny-model factory version and this module's version): a second call returns at once.
Concurrent callers (several ranks) wait on a file lock and the first one builds.

`python -m yatt_mm.demo.warmstart {policy,judge} DATA_DIR [--measure]` builds (or finds) a warm
start and, with --measure, scores it with vLLM on fresh samples (see `measure_policy` and
`measure_judge`) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WARMSTART_VERSION = 4  # 3: the judge learns in two stages; 4: its first stage stops when it has learnt
GROUNDING_SFT_STEPS = 60

# SFT stages of each kind, each starting from the previous one's weights. Small settings for the
# 2-core CPU: policy ~10 s of training on an idle machine, judge ~2.5-5 min (much longer when other
# jobs share the cores). The judge's first stage has only 16 distinct prompts (4 references x 4
# responses), so a step of 32 runs ~14 rows: the SFT step computes repeated text-only examples once
# (yatt_mm/sft/collate.py, merge_duplicates_of), ~0.1 s a step here.
SETTINGS = {
    "policy": [{"examples": "answer", "steps": 12, "lr": 3e-4, "batch_size": 16}],
    # a student far from the task, for on-policy distillation (docs/distillation.md): the answer format only,
    # each colour word at random whatever the image (chance accuracy); the same steps as `policy`
    "format_only": [{"examples": "random_answer", "steps": 12, "lr": 3e-4, "batch_size": 16}],
    # the tiny Qwen3-VL (tiny:qwen3vl), for RL tests of that family: the same weak start
    # (it learns faster: 8 steps give what 12 give the Qwen2-VL one, greedy accuracy 0.62)
    "qwen3vl": [{"examples": "answer", "steps": 8, "lr": 3e-4, "batch_size": 16}],
    # the tiny policy that calls the `zoom` tool, then answers (multi-turn rollouts, tests)
    "tools": [{"examples": "zoom", "steps": 40, "lr": 1e-3, "batch_size": 16}],
    "qwen3vl_tools": [{"examples": "zoom", "steps": 40, "lr": 1e-3, "batch_size": 16}],  # the same, Qwen3-VL
    # the tiny policy that answers a box [x1, y1, x2, y2] (the grounding task; iou/giou rewards):
    # the format and a rough guess, for RL to sharpen
    "grounding": [{"examples": "answer", "steps": GROUNDING_SFT_STEPS, "lr": 1e-3, "batch_size": 16}],
    # the comparison is learnt suddenly, after a plateau whose length varies with the numerics
    # (library versions, thread counts, float rounding: 700 to 1400 steps seen here, once 2400):
    # the first stage runs until its held-out accuracy reaches stop_at, within a generous cap
    "judge": [{"examples": "judge_compare", "steps": 2500, "lr": 5e-4, "warmup_steps": 50, "batch_size": 32,
               "eval_every": 100, "stop_at": 0.98},
              {"examples": "judge", "steps": 200, "lr": 5e-4, "batch_size": 16}],
}
BASE = {"tools": "policy", "qwen3vl_tools": "qwen3vl", "grounding": "policy", "format_only": "policy"}  # where it is not tiny:KIND
TASKS = ["image/colour"]  # the synthetic tasks a kind's SFT reads (dataio.synth), unless KIND_TASKS says
KIND_TASKS = {"grounding": ["image/grounding"]}


def _data_fingerprint(data_dir: str | Path) -> str:
    from dataio.index import expand_shards, open_dataset

    shards = expand_shards([str(data_dir)])
    h = hashlib.sha1(open_dataset(shards).fingerprint().encode())
    for s in sorted(shards):  # the index fingerprint sees names and keys; sizes catch rewritten content
        h.update(f"{os.path.basename(s)}:{os.path.getsize(s)}".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    from models.tiny import cache_root

    return cache_root() / "warmstart"


def cache_key(kind: str, data_dir: str | Path, steps: int | None, seed: int) -> str:
    from models.tiny import FACTORY_VERSION

    parts = {"kind": kind, "seed": seed, "steps": steps, "data": _data_fingerprint(data_dir),
             "factory": FACTORY_VERSION, "warmstart": WARMSTART_VERSION, "settings": SETTINGS[kind],
             "tasks": KIND_TASKS.get(kind, TASKS)}
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(kind: str, data_dir: str | Path, cache_dir: str | Path | None = None, steps: int | None = None,
               seed: int = 0, quiet: bool = False) -> Path:
    """HF directory of the warm-started tiny `kind` model (a key of SETTINGS: "policy", "judge",
    "tools", ...), trained on the colour questions of the shards in `data_dir` (`yatt-mm data
    synth` output); cached.
    `steps` replaces every stage's step count (short runs for tests)."""
    if kind not in SETTINGS:
        raise ValueError(f"warm_start kind must be one of {', '.join(SETTINGS)}, got {kind!r}")
    if not Path(data_dir).exists():
        raise FileNotFoundError(f"warm_start: data dir {data_dir} not found (make one with `yatt-mm data synth DIR`)")
    stages = [{**s, "steps": steps or s["steps"]} for s in SETTINGS[kind]]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / f"{kind}-{cache_key(kind, data_dir, steps, seed)}"
    if (out / "yatt_sft.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        if (out / "yatt_sft.json").is_file():
            return out
        run_dir = cache / f".{out.name}.run"
        t0 = time.time()
        model = f"tiny:{BASE.get(kind, kind)}"
        for i, stage in enumerate(stages):
            last = i == len(stages) - 1
            stage_out = out if last else run_dir / f"stage{i}-hf"
            if not quiet:
                print(f"warm_start: training the tiny {kind}, stage {i + 1}/{len(stages)}: {stage['steps']} SFT "
                      f"steps of {stage['examples']} examples into {stage_out}", file=sys.stderr, flush=True)
            _run_sft_stage(kind, model, stage, data_dir, seed, run_dir / f"stage{i}", stage_out, quiet)
            model = str(stage_out)
        if not quiet:
            print(f"warm_start: {kind} ready in {time.time() - t0:.0f}s: {out}", file=sys.stderr, flush=True)
    return out


def _run_sft_stage(kind: str, model: str, stage: dict, data_dir: str | Path, seed: int, run_dir: Path,
                   out: Path, quiet: bool) -> None:
    steps, batch = stage["steps"], stage["batch_size"]
    overrides = [f"model={model}", f"examples=yatt_mm.demo.examples:{stage['examples']}_example",
                 f"data.shards=[{Path(data_dir).resolve()}]", f"data.seed={seed}",
                 f"tasks=[{','.join(KIND_TASKS.get(kind, TASKS))}]",
                 f"steps={steps}", f"batch_size={batch}",
                 f"micro_batch_size={batch}", f"trainer.lr={stage['lr']}", f"warmup_steps={stage.get('warmup_steps', 0)}",
                 f"trainer.seed={1234 + seed}", f"seed={seed}", f"eval.every={stage.get('eval_every', 0)}",
                 f"eval.stop_at={stage.get('stop_at', 0.0)}", "eval.samples=64",
                 f"log_every={max(1, steps // 10)}", f"run_dir={run_dir}", f"output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.sft.train", *overrides], capture_output=quiet, text=True,
                          cwd=Path(__file__).resolve().parents[2], env=_standalone_env())
    if proc.returncode != 0 or not (out / "yatt_sft.json").is_file():
        tail = (proc.stderr or "")[-3000:] if quiet else "(see the output above)"
        raise RuntimeError(f"warm_start({kind!r}) SFT of {stage['examples']} examples failed with exit code "
                           f"{proc.returncode}: {tail}")


def _standalone_env() -> dict[str, str]:
    """The environment without torchrun's variables: called from a rank of a torchrun job, the
    SFT child would otherwise join the parent's rendezvous as that rank and wait forever."""
    torchrun = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in torchrun and not k.startswith("TORCHELASTIC_")}


# ---------------------------------------------------------------- measurements (vLLM)


def _fresh_colour_samples(n: int, seed: int):
    """Colour questions from the synthetic generator with a seed no shard uses: never trained on."""
    import random

    from dataio.synth import colour_image

    rng = random.Random(10_000_019 + seed)
    return [colour_image(rng) for _ in range(n)]


def measure_policy(model_dir: str | Path, n: int = 64, samples_per_prompt: int = 4, engine=None) -> dict:
    """Rate of responses that are exactly one colour word, and accuracy, sampled at temperature
    1 (as RL samples) and greedily."""
    from dataio.synth import COLOURS
    from yatt_mm.reward.rules import exact_match, extract_answer
    from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine, SamplingConfig

    engine = engine or RolloutEngine(EngineConfig(model=str(model_dir)))
    samples = _fresh_colour_samples(n, 1)
    reqs = [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}],
                    images=[s.image]) for s in samples]
    out = {}
    for name, sampling in (("sampled", SamplingConfig(n=samples_per_prompt, max_tokens=8, temperature=1.0, seed=None)),
                           ("greedy", SamplingConfig(n=1, max_tokens=8, temperature=0.0))):
        res = engine.generate(reqs, sampling)
        pairs = [(r.text, s.answer) for group, s in zip(res.responses, samples) for r in group]
        out[f"{name}/colour_word_rate"] = sum(extract_answer(t) in COLOURS for t, _ in pairs) / len(pairs)
        out[f"{name}/accuracy"] = sum(exact_match(t, a) for t, a in pairs) / len(pairs)
        out[f"{name}/responses"] = len(pairs)
    return out


def judge_pairs(n: int, seed: int = 2, near_misses: bool = False):
    """Held-out (question, image, response, answer) items and the rule's verdicts: balanced true
    and wrong answers, or with `near_misses`, slips an early policy makes (examples.judge_response)."""
    import random

    from yatt_mm.reward.genrm import JudgeItem
    from yatt_mm.reward.rules import exact_match
    from yatt_mm.demo.examples import TASK_CHOICES, judge_response

    rng = random.Random(seed)
    items, rule = [], []
    for i, s in enumerate(_fresh_colour_samples(n, seed)):
        if near_misses:
            response = judge_response(s.answer, TASK_CHOICES["colour"], rng, near_misses=True)
        else:
            wrong = [c for c in TASK_CHOICES["colour"] if c != s.answer]
            response = s.answer if i % 2 == 0 else rng.choice(wrong)
        items.append(JudgeItem(s.question, response, s.answer, images=[s.image]))
        rule.append(exact_match(response, s.answer))
    return items, rule


def measure_judge(judge_dir: str | Path, n: int = 128, engine=None) -> dict:
    """Agreement of the judge (vLLM, temperature 0, InProcessJudge with the default template)
    with the rule reward `exact_match` on balanced held-out pairs (a constant judge gets 0.5),
    and on held-out responses a third of which are near misses."""
    from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine

    engine = engine or RolloutEngine(EngineConfig(model=str(judge_dir)))
    judge = InProcessJudge(JudgeConfig(model=str(judge_dir), temperature=0.0, votes=1, max_tokens=8), engine=engine)
    out = {}
    for name, near in (("", False), ("_with_near_misses", True)):
        items, rule = judge_pairs(n, near_misses=near)
        scores = judge.score(items)
        agree = [float(s.score == r) for s, r in zip(scores, rule)]
        pos = [a for a, r in zip(agree, rule) if r == 1.0]
        neg = [a for a, r in zip(agree, rule) if r == 0.0]
        out.update({f"judge/agreement{name}": sum(agree) / len(agree),
                    f"judge/agreement_on_correct{name}": sum(pos) / max(len(pos), 1),
                    f"judge/agreement_on_wrong{name}": sum(neg) / max(len(neg), 1),
                    f"judge/unparsed{name}": sum(s.failure is not None for s in scores) / len(scores)})
        if not near:
            out["judge/example_texts"] = [s.texts[0] if s.texts else "" for s in scores[:4]]
    out["judge/pairs"] = n
    return out


def main(argv: list[str] | None = None) -> int:
    import models  # noqa: F401 - CPU runtime hooks first

    parser = argparse.ArgumentParser(prog="python -m yatt_mm.demo.warmstart")
    parser.add_argument("kind", choices=sorted(SETTINGS))
    parser.add_argument("data_dir")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", action="store_true", help="score the result with vLLM on fresh samples")
    args = parser.parse_args(argv)
    t0 = time.time()
    path = warm_start(args.kind, args.data_dir, args.cache_dir, args.steps, args.seed)
    result = {"kind": args.kind, "path": str(path), "seconds": time.time() - t0}
    info = json.loads((path / "yatt_sft.json").read_text())
    result["sft_eval_after"] = info.get("eval_after")
    if args.measure:
        result.update(measure_judge(path) if args.kind == "judge" else measure_policy(path))
        (path / "measured.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
