"""One RL step of yatt-mm against Hugging Face TRL's GRPOTrainer, on the same work.

Both sides: the same model directory (the warm-started tiny Qwen2-VL; in the `wide` setting a
wider, deeper one built offline from the same factory), the same colour-question images read
from the same shards, 8 prompts x 8 completions, exact-match reward, lr 5e-5, PPO clip
0.2 / 0.28, token-level loss, no KL, fp32, every group trained (no dynamic sampling), one
process. yatt-mm: `yatt-mm rl --nproc 1` (vLLM rollout, Megatron trainer). TRL: `GRPOTrainer`
with transformers generation (no vLLM: TRL's vLLM path needs a CUDA device). Rounds alternate
between the two so machine noise falls on both; the figure per side is the median over rounds of
the median step time of steps 2-6 (step 1 pays one-time warm-up).

TRL is an optional benchmark dependency: `pip install -e '.[bench]'` (trl, accelerate and
datasets, pinned; torch and transformers stay as they are).

    python benchmarks/bench_rl_vs_trl.py [--setting tiny|wide|both] [--rounds 2]

Last line: JSON with yatt_s_per_step, trl_s_per_step, ratio (TRL / yatt-mm; > 1: yatt-mm is
faster) for the tiny setting, and the same keys under "wide" when it ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
PROMPTS, COMPLETIONS, LR = 8, 8, 5e-5
SETTINGS = {  # max completion tokens, and the model: the warm start, or a wider one built offline
    "tiny": {"max_tokens": 8, "model": "warmstart"},
    "wide": {"max_tokens": 64, "model": "wide"},
}


def data_dir(root: Path) -> Path:
    from dataio.synth import write_shards

    out = root / "train"
    if not out.exists():
        write_shards(str(out), images=128, videos=0, samples_per_shard=32, seed=11, tasks=["colour"])
    return out


def model_dir(kind: str, data: Path) -> Path:
    if kind == "warmstart":
        from yatt_mm.demo.warmstart import warm_start

        return warm_start("policy", data, quiet=True)
    from models.tiny import TinySpec, build_tiny_model, cache_root

    out = cache_root() / "bench" / "policy-wide-4x256"
    if not (out / "yatt_tiny.json").is_file():  # untrained: answers run to max_tokens, generation weighs more
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp, "policy", spec=TinySpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                                       intermediate_size=512))
        tmp.rename(out)
    return out


# -- yatt-mm ----------------------------------------------------------------------------------

def yatt_round(model: Path, data: Path, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", "1",
               f"run.run_dir={tmp}/run", f"run.steps={STEPS}", f"data.shards=[{data}]", f"policy.model={model}",
               f"rollout.prompts_per_step={PROMPTS}", f"rollout.sampling.n={COMPLETIONS}",
               f"rollout.sampling.max_tokens={max_tokens}", "rollout.sampling.temperature=1.0",
               "dynamic_sampling.enabled=false", "reward.judges=[]", f"policy.trainer.lr={LR}",
               "algorithm.clip_low=0.2", "algorithm.clip_high=0.28", "algorithm.loss_agg=token",
               "algorithm.kl_coef=0", "policy.trainer.dtype=fp32", "eval.every=0", "run.save_final=false",
               "data.workers=0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"yatt-mm run failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r][1:]
    phases = {k[5:] for r in steps for k in r if k.startswith("time/")} - {"step", "idle", "idle_share"}
    return {"s_per_step": statistics.median(r["time/step"] for r in steps),
            "phases": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steps) for p in sorted(phases)}}


# -- TRL --------------------------------------------------------------------------------------

def trl_round(model: Path, data: Path, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        cmd = [sys.executable, __file__, "--trl-worker", json.dumps(
            {"model": str(model), "data": str(data), "max_tokens": max_tokens, "out": str(out), "tmp": tmp})]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800, env=env)
        if proc.returncode != 0:
            sys.exit(f"TRL run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def trl_worker(args: dict) -> None:
    """In its own process: TRL's GRPOTrainer for STEPS steps, each step timed by a callback,
    and the generation + scoring part of each step by wrapping the trainer's method for it."""
    import models  # noqa: F401 - the CPU runtime hooks (torchvision) before transformers loads processors
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dataio.reader import DataConfig, DataReader
    from yatt_mm.reward.rules import get_rule

    reader = DataReader(DataConfig(shards=[args["data"]], shuffle=False, workers=0), 0, 1)
    rows = [{"prompt": [{"role": "user", "content": s.prompt}], "image": s.images[0], "answer": s.answer}
            for s in reader.iter_epoch()]
    exact = get_rule("exact_match")

    def exact_match(completions, answer, **_):
        return [float(exact(c[0]["content"], a, {})) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=args["tmp"], per_device_train_batch_size=PROMPTS * COMPLETIONS, num_generations=COMPLETIONS,
        max_completion_length=args["max_tokens"], learning_rate=LR, lr_scheduler_type="constant",
        epsilon=0.2, epsilon_high=0.28, loss_type="dapo", beta=0.0, temperature=1.0, max_steps=STEPS,
        num_iterations=1, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, max_grad_norm=1.0,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0)
    model = AutoModelForImageTextToText.from_pretrained(args["model"], dtype="float32")
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match], args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoProcessor.from_pretrained(args["model"]))
    steps, generate = [], []
    original = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            generate.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    trainer.train()
    step_s = statistics.median(steps[1:])
    gen_s = statistics.median(generate[1:])
    Path(args["out"]).write_text(json.dumps({"s_per_step": step_s, "phases": {
        "generate+score": gen_s, "train (forward, backward, AdamW)": step_s - gen_s}}))


# -- the comparison ---------------------------------------------------------------------------

def compare(name: str, rounds: int, root: Path) -> dict:
    data = data_dir(root)
    setting = SETTINGS[name]
    model = model_dir(setting["model"], data)
    yatt, trl = [], []
    for r in range(rounds):
        for side, fn, out in (("yatt-mm", yatt_round, yatt), ("trl", trl_round, trl)):
            res = fn(model, data, setting["max_tokens"])
            out.append(res)
            print(f"[{name}] round {r + 1}/{rounds} {side:8s} {res['s_per_step']:.3f} s/step  "
                  + " ".join(f"{k}={v:.3f}" for k, v in res["phases"].items()), flush=True)
    y = statistics.median(x["s_per_step"] for x in yatt)
    t = statistics.median(x["s_per_step"] for x in trl)
    print(f"[{name}] {PROMPTS} prompts x {COMPLETIONS} completions <= {setting['max_tokens']} tokens, model {model.name}: "
          f"yatt-mm {y:.3f} s/step, TRL {t:.3f} s/step, TRL/yatt-mm {t / y:.2f}", flush=True)
    return {"yatt_s_per_step": round(y, 4), "trl_s_per_step": round(t, 4), "ratio": round(t / y, 3),
            "yatt_phases_s": {k: round(v, 4) for k, v in yatt[-1]["phases"].items()},
            "trl_phases_s": {k: round(v, 4) for k, v in trl[-1]["phases"].items()}}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=["tiny", "wide", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed: pip install -e '.[bench]'")
    root = Path(tempfile.gettempdir()) / "yatt-mm-bench-rl-vs-trl"
    names = ["tiny", "wide"] if args.setting == "both" else [args.setting]
    results = {name: compare(name, args.rounds, root) for name in names}
    first = results[names[0]]
    print(json.dumps({**{k: first[k] for k in ("yatt_s_per_step", "trl_s_per_step", "ratio")},
                      "setting": names[0], **{n: results[n] for n in names}}))


if __name__ == "__main__":
    main()
