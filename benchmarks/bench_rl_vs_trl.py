"""One RL step of yatt-mm against Hugging Face TRL's GRPOTrainer, on the same work.

Both sides: the same model directory (the warm-started tiny Qwen2-VL; in the `wide` setting a
wider, deeper one built offline from the same factory), the same colour-question images read
from the same shards, 8 prompts x 8 completions, exact-match reward, lr 5e-5, PPO clip
0.2 / 0.28, token-level loss, no KL, fp32, every group trained (no dynamic sampling), one
process. yatt-mm: `yatt-mm rl --nproc 1 --config configs/tiny_demo.yaml` (vLLM rollout, Megatron
trainer) with only that shared work overridden: every other setting (data workers, the sync
probe, metrics writers, micro-batch size, ...) stays at the demo config's defaults, the settings
users run. TRL: `GRPOTrainer` with transformers generation (no vLLM: TRL's vLLM path needs a CUDA
device), at its defaults too. Extra rows time yatt-mm with other settings on top of the same
work (EXTRA_ROWS; the previous figures used data.workers=0). Rounds alternate between the runs so
machine noise falls on all; the figure per run is the median over rounds of the median step time
of steps 2-6 (step 1 pays one-time warm-up). Run it on a quiet machine: under load from other work
TRL's step grows 10-30x (libgomp's spinning threads), yatt-mm's far less; the per-round figures
in the JSON show it.

TRL is an optional benchmark dependency: `pip install -e '.[bench]'` (trl, accelerate and
datasets, pinned; torch and transformers stay as they are). Without it a measurement refuses to
start; a smoke run (BENCH_SMOKE=1) times yatt-mm's side alone and reports TRL's figures as null.

    python benchmarks/bench_rl_vs_trl.py [--setting tiny|wide|both] [--rounds 2] [--defaults-only]

Last line: JSON with yatt_s_per_step, trl_s_per_step, ratio (TRL / yatt-mm; > 1: yatt-mm is
faster) for the tiny setting at the defaults, and the same keys under "wide" when it ran; each
setting's "rows" holds the defaults and every extra row (yatt_s_per_step, ratio, phases, rounds).
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

from _common import ROOT, SMOKE, full_or_smoke, output_root

STEPS = full_or_smoke(6, 2)  # step 1 pays one-time warm-up and is left out
PROMPTS, COMPLETIONS, LR = 8, 8, 5e-5
SETTINGS = {  # max completion tokens, and the model: the warm start, or a wider one built offline
    "tiny": {"max_tokens": 8, "model": "warmstart"},
    "wide": {"max_tokens": 64, "model": "wide"},
}
# yatt-mm with settings beyond the shared work, each timed as its own row beside the defaults:
# data.workers=0 (decode in the rank's thread) is what this benchmark ran before it measured the
# defaults; paired runs found no difference at this size (docs/benchmarks.md)
EXTRA_ROWS = {"data.workers=0": ["data.workers=0"]}


def data_dir(root: Path) -> Path:
    from dataio.synth import write_shards

    if SMOKE:  # the demo's data: its warm start is the one the other RL benchmarks' smoke runs build
        from _rl import demo_data

        return demo_data() / "train"
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

def yatt_round(model: Path, data: Path, max_tokens: int, extra: tuple[str, ...] = ()) -> dict:
    """`extra`: overrides beyond the shared work (none: the demo config's defaults)."""
    with tempfile.TemporaryDirectory() as tmp:
        # the work both sides do, and nothing else: the run (steps, where), data and model, the
        # sampling, the reward (the rule only), the hyper-parameters, fp32, no dynamic sampling,
        # no eval and no final save (TRL saves nothing; the save comes after the timed steps)
        cmd = [sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", "1",
               f"run.run_dir={tmp}/run", f"run.steps={STEPS}", f"data.shards=[{data}]", f"policy.model={model}",
               f"rollout.prompts_per_step={PROMPTS}", f"rollout.sampling.n={COMPLETIONS}",
               f"rollout.sampling.max_tokens={max_tokens}", "rollout.sampling.temperature=1.0",
               "dynamic_sampling.enabled=false", "reward.judges=[]", f"policy.trainer.lr={LR}",
               "algorithm.clip_low=0.2", "algorithm.clip_high=0.28", "algorithm.loss_agg=token",
               "algorithm.kl_coef=0", "policy.trainer.dtype=fp32", "eval.every=0", "run.save_final=false",
               *extra]
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
        # TRL as its users run it: no launcher of its own, so libgomp's spinning OMP_WAIT_POLICY
        # (yatt-mm's ranks get PASSIVE, yatt_mm/launch.py). PASSIVE made TRL's step 1.3-1.6x
        # slower on a quiet machine here; spinning made it 7-13 s instead of 0.4 s while other
        # work loaded the 2 cores: compare the rounds' figures (yatt_rounds_s, trl_rounds_s)
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

def compare(name: str, rounds: int, root: Path, extra_rows: dict[str, list[str]], with_trl: bool = True) -> dict:
    """`with_trl` False (a smoke run without TRL installed): yatt-mm's runs only, TRL's figures null."""
    data = data_dir(root)
    setting = SETTINGS[name]
    model = model_dir(setting["model"], data)
    runs = {"defaults": lambda: yatt_round(model, data, setting["max_tokens"]),
            **({"trl": lambda: trl_round(model, data, setting["max_tokens"])} if with_trl else {}),
            **{row: (lambda o=tuple(o): yatt_round(model, data, setting["max_tokens"], o))
               for row, o in extra_rows.items()}}
    results: dict[str, list[dict]] = {k: [] for k in runs}
    for r in range(rounds):
        for side in (list(runs) if r % 2 == 0 else list(runs)[::-1]):  # every other round backwards
            res = runs[side]()
            results[side].append(res)
            label = "trl" if side == "trl" else f"yatt-mm {side}"
            print(f"[{name}] round {r + 1}/{rounds} {label:24s} {res['s_per_step']:.3f} s/step  "
                  + " ".join(f"{k}={v:.3f}" for k, v in res["phases"].items()), flush=True)
    t = statistics.median(x["s_per_step"] for x in results["trl"]) if with_trl else None
    rows = {}
    for row, res in results.items():
        if row == "trl":
            continue
        y = statistics.median(x["s_per_step"] for x in res)
        trl = f"TRL {t:.3f} s/step, TRL/yatt-mm {t / y:.2f}" if with_trl else "TRL not installed"
        print(f"[{name}] {PROMPTS} prompts x {COMPLETIONS} completions <= {setting['max_tokens']} tokens, model "
              f"{model.name}: yatt-mm ({row}) {y:.3f} s/step, {trl}", flush=True)
        rows[row] = {"yatt_s_per_step": round(y, 4), "trl_s_per_step": round(t, 4) if with_trl else None,
                     "ratio": round(t / y, 3) if with_trl else None,
                     "yatt_phases_s": {k: round(v, 4) for k, v in res[-1]["phases"].items()},
                     "yatt_rounds_s": [round(x["s_per_step"], 4) for x in res]}
    keys = ("yatt_s_per_step", "trl_s_per_step", "ratio", "yatt_phases_s", "yatt_rounds_s")
    return {**{k: rows["defaults"][k] for k in keys},
            "trl_phases_s": {k: round(v, 4) for k, v in results["trl"][-1]["phases"].items()} if with_trl else None,
            "trl_rounds_s": [round(x["s_per_step"], 4) for x in results["trl"]] if with_trl else None, "rows": rows}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # a smoke run: the tiny setting, one round, no extra rows
    parser.add_argument("--setting", choices=["tiny", "wide", "both"], default=full_or_smoke("both", "tiny"))
    parser.add_argument("--rounds", type=int, default=full_or_smoke(2, 1))
    parser.add_argument("--defaults-only", action="store_true", default=SMOKE,
                        help="no extra rows: yatt-mm at the defaults and TRL")
    args = parser.parse_args()
    with_trl = importlib.util.find_spec("trl") is not None
    if not with_trl and not SMOKE:
        sys.exit("TRL is not installed: pip install -e '.[bench]'")
    if not with_trl:
        print("TRL is not installed: this smoke run times yatt-mm's side only", flush=True)
    root = full_or_smoke(Path(tempfile.gettempdir()), output_root()) / "yatt-mm-bench-rl-vs-trl"
    names = ["tiny", "wide"] if args.setting == "both" else [args.setting]
    extra_rows = {} if args.defaults_only else EXTRA_ROWS
    results = {name: compare(name, args.rounds, root, extra_rows, with_trl) for name in names}
    first = results[names[0]]
    print(json.dumps({**{k: first[k] for k in ("yatt_s_per_step", "trl_s_per_step", "ratio", "rows")},
                      "setting": names[0], **{n: results[n] for n in names}}))


if __name__ == "__main__":
    main()
