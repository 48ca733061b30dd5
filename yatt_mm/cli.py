"""The `yatt-mm` command. Each subcommand imports its implementation only when it runs, so
`yatt-mm --help` answers at once."""

from __future__ import annotations

import argparse
import os
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from models.tiny import make_tiny_model

    path, built = make_tiny_model(args.dir, kind=args.kind, seed=args.seed)
    print(f"{'built' if built else 'already built'}: tiny {args.kind} model (seed {args.seed}) in {path}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from yatt_mm.doctor import run_doctor

    return run_doctor(live=not args.no_live)


def _demo(args: argparse.Namespace) -> int:
    from yatt_mm.demo import make_data, run_demo

    if args.data_only:  # the shards the tiny configs read (runs/demo-data), without the run
        make_data()
        return 0
    return run_demo(run_dir=args.run_dir, nproc=args.nproc, overrides=args.overrides, verbose=args.verbose)


def _plot(args: argparse.Namespace) -> int:
    from yatt_mm.plot import plot_run

    for path in plot_run(args.run_dir):
        print(f"wrote {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    from models.lora import read_adapter_dir
    from yatt_mm.config import ConfigError, load
    from yatt_mm.launch import resolve_model
    from yatt_mm.rl.config import RLConfig

    overrides = list(args.overrides) + ([f"policy.model={args.model}"] if args.model else [])
    try:
        cfg = load(RLConfig, args.config, overrides)
        if not cfg.eval.filled():
            raise ConfigError("the config has no eval set: give eval.shards=[DIR] or eval.sets=[{name, shards}]")
        cfg.eval.check_inputs()  # FileNotFoundError: one line and exit 2 (main)
        if args.dp_size < 1:
            raise ConfigError(f"--dp-size must be >= 1, got {args.dp_size}")
        if cfg.rollout.engine.tensor_parallel_size > 1:
            raise ConfigError("yatt-mm eval runs one engine in this process: set rollout.engine.tensor_parallel_size=1 "
                              f"(now {cfg.rollout.engine.tensor_parallel_size}); a run's own eval covers TP engines")
        adapter = read_adapter_dir(cfg.policy.model)  # a LoRA run's final: served on its base
        if adapter is None:
            cfg.policy.model = resolve_model(cfg.policy.model, cfg.data.all_shards())
        else:
            from yatt_mm.engines.adapters import check_adapter_serving

            base = resolve_model(adapter["base_model_name_or_path"])  # the base must be there
            check_adapter_serving(base, f"--model {cfg.policy.model} (a LoRA adapter)",
                                  "merge it into its base first (yatt-mm export ADAPTER_DIR --merge --out DIR) and "
                                  "evaluate DIR")
    except (ConfigError, ValueError) as e:
        print(f"yatt-mm eval: {e}", file=sys.stderr)
        return 2
    from yatt_mm.rl.evaluation import evaluate_policy

    out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    print(json.dumps(evaluate_policy(cfg, out, args.dp_size)))
    print(f"wrote {out / 'eval.json'} and {out / 'answers.jsonl'}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from models.lora import merge_adapter_dir

    if list(Path(args.adapter).glob("done_rank*")):  # a checkpoint directory of an RL run
        from yatt_mm.rl.export import export_checkpoint

        try:
            return export_checkpoint(args.adapter, args.out, args.merge, args.with_optimizer)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(f"yatt-mm export: {e}", file=sys.stderr)
            return 2
    if not args.merge:
        print("yatt-mm export: a LoRA run's RUN_DIR/final is already a PEFT adapter that peft and vLLM load; give "
              "--merge for the merged HF model", file=sys.stderr)
        return 2
    try:
        out = merge_adapter_dir(args.adapter, args.out, args.base)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"yatt-mm export: {e}", file=sys.stderr)
        return 2
    print(f"merged HF model written to {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from yatt_mm.plan import Assumptions, run_plan

    # the flags given replace the config's `cluster` figures; those not given leave them
    flags = {"gpus_per_node": args.gpus_per_node, "gpu_memory_gib": args.gpu_memory_gb, "nodes": args.nodes,
             "host_memory_gib": args.host_memory_gb}
    assume = Assumptions(seq_len=args.seq_len, media_tokens=args.media_tokens, frame_tokens=args.frame_tokens)
    return run_plan(args.config, args.overrides, {k: v for k, v in flags.items() if v is not None}, assume)


def _simulate(args: argparse.Namespace) -> int:
    from yatt_mm.simulate.cluster import ClusterWorkload
    from yatt_mm.simulate.command import run_simulate

    work = ClusterWorkload(policy_params_b=args.policy_b, judge_params_b=args.judge_b, max_tokens=args.max_tokens,
                           prompt_tokens=args.prompt_tokens, responses_per_step=args.responses,
                           judge_tokens=args.judge_tokens, votes=args.votes)
    try:
        return run_simulate(args.run_dir, args.placement, args.profile, args.gpus, args.rank, args.png, work,
                            args.staleness, args.rollout_gpus)
    except ValueError as e:  # a run dir it cannot replay, a bad profile or workload: the message names the fix
        print(f"yatt-mm simulate: {e}", file=sys.stderr)
        return 2


def _model_parity(args: argparse.Namespace) -> int:
    import subprocess

    from yatt_mm.launch import relaunch

    if args.tp < 1 or args.pp < 1 or args.ep < 1:
        raise SystemExit("--tp, --pp and --ep must be >= 1")
    from models.family import family_for_dir

    from models.family import read_spec

    try:
        family = family_for_dir(args.hf_dir)
        parity = family.parity_module  # the model's family compares its logits
        layers = tuple(int(n) for n in args.pipeline_layers.split(",") if n.strip()) if args.pipeline_layers else ()
        spec = read_spec(args.hf_dir)
        if args.ep > 1 and not getattr(spec, "num_experts", 0):
            raise ValueError(f"--ep {args.ep}: {args.hf_dir} has no experts ({spec.model_type})")
        experts = {"ep": args.ep} if args.ep > 1 else {}
        family.check_layout(spec, args.tp, args.pp, "", layers, **experts)  # before any rank starts
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"yatt-mm model parity: {e}") from e
    if args.tp * args.pp * args.ep == 1:
        return subprocess.call([sys.executable, "-m", parity, args.hf_dir])  # output streams through
    # under EP the experts spread over data-parallel ranks: ep replicas of the TP x PP layout
    return relaunch(parity, args.tp * args.pp * args.ep, [args.hf_dir, "--tp", str(args.tp), "--pp", str(args.pp)]
                    + (["--pipeline-layers", ",".join(map(str, layers))] if layers else [])
                    + (["--ep", str(args.ep)] if args.ep > 1 else []))


def ClusterWorkloadDefaults():  # noqa: N802 - the dataclass's defaults, without importing the simulator
    from yatt_mm.simulate.cluster import ClusterWorkload

    return ClusterWorkload()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yatt-mm",
        description="RL for vision-language models on image and video data, one controller per DP group.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="the tiny CPU demo: data, warm starts, then RL with configs/tiny_demo.yaml")
    p.add_argument("--run-dir", default=None, help="where to write outputs (default: runs/tiny-demo-TIME)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (DP groups on CPU)")
    p.add_argument("--verbose", action="store_true", help="the libraries' log lines (vLLM, Megatron, torch, "
                   "transformers) on the terminal too, not only in RUN_DIR/logs/")
    p.add_argument("--data-only", action="store_true", help="only make the demo's shards (runs/demo-data/train "
                   "and eval, which the tiny configs read), once")
    p.add_argument("overrides", nargs="*", help="key=value settings for the RL config, e.g. run.steps=10")
    p.set_defaults(func=_demo)

    p = sub.add_parser("doctor", help="check versions, devices and that vLLM and Megatron-Core run here")
    p.add_argument("--no-live", action="store_true", help="skip the live vLLM and Megatron checks")
    p.set_defaults(func=_doctor)

    from models.family import families  # the registered families; importing them is cheap

    family_names = ", ".join(f.name for f in families())
    # rl and sft parse their own arguments (yatt_mm/launch.py): listed here for --help only
    sub.add_parser("rl", help=f"RL (GRPO family) of a vision-language policy ({family_names}): one controller "
                   "per DP group "
                   "(--config C [--nproc N] [--help-config] [key=value ...])")

    p = sub.add_parser("plan", help="memory plan of an RL config per phase and GPU on the cluster it states "
                       "(its cluster section; the flags override it): does it fit, and if not, which setting to "
                       "change (exit 0: fits, 1: does not)")
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/qwen2vl_7b_8gpu.yaml")
    # None: not given; the config's `cluster` section, else the plan's default (yatt_mm/plan/cluster.py)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node (default: the config's cluster.gpus_per_node, else 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory of one GPU, GiB (default: the config's cluster.gpu_memory_gib, else 80)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the config's cluster.nodes, else 1)")
    p.add_argument("--host-memory-gb", type=float, default=None, help="host memory per node, GiB; 0: not checked "
                   "(default: the config's cluster.host_memory_gib, else 0)")
    p.add_argument("--seq-len", type=int, default=0, help="longest training row (default: rollout.engine.max_model_len)")
    p.add_argument("--media-tokens", type=int, default=-1,
                   help="media tokens per sample (default: one image or video at the data.media limits)")
    p.add_argument("--frame-tokens", type=int, default=0, help="merged tokens per image/frame (default: data.media)")
    p.add_argument("overrides", nargs="*", help="key=value settings for the RL config, e.g. run.micro_batch_tokens=8192")
    p.set_defaults(func=_plan)

    p = sub.add_parser("simulate", help="replay a run's measured timings under full and partial colocation, here "
                       "or (with a GPU profile) on a cluster: step time, idle share, utilisation per role, a PNG")
    p.add_argument("run_dir", help="the run directory of a `yatt-mm rl` run (its timeline_rank*.jsonl)")
    p.add_argument("--placement", choices=["full", "partial", "both"], default="both")
    p.add_argument("--profile", default=None, help="device profile YAML (configs/profiles/): a CPU calibration, or "
                   "a GPU node's published figures to scale the run to a cluster")
    p.add_argument("--gpus", type=int, default=0, help="GPU profile: GPUs in the cluster (default: one node)")
    p.add_argument("--rank", type=int, default=None, help="whose timeline (a DP group's controller; default 0)")
    p.add_argument("--png", default=None, help="where to draw the timelines (default: RUN_DIR/simulated_*.png)")
    p.add_argument("--staleness", type=int, default=None, help="instead: this synchronous run's step time at "
                   "run.max_staleness K (rollout generating ahead), here or on a GPU profile, and what bounds it")
    p.add_argument("--rollout-gpus", type=int, default=0, help="GPU, with --staleness: GPUs generating (default: "
                   "the split predicted fastest); the trainer has the rest")
    cluster = ClusterWorkloadDefaults()
    p.add_argument("--policy-b", type=float, default=cluster.policy_params_b, help="GPU: policy size, B parameters")
    p.add_argument("--judge-b", type=float, default=cluster.judge_params_b, help="GPU: judge size, B parameters")
    p.add_argument("--max-tokens", type=int, default=cluster.max_tokens, help="GPU: the run's max_tokens scaled to")
    p.add_argument("--prompt-tokens", type=int, default=cluster.prompt_tokens, help="GPU: tokens per prompt")
    p.add_argument("--responses", type=int, default=cluster.responses_per_step, help="GPU: responses per step")
    p.add_argument("--judge-tokens", type=int, default=cluster.judge_tokens, help="GPU: judge answer tokens per vote")
    p.add_argument("--votes", type=int, default=cluster.votes, help="GPU: judge votes per response")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("eval", help="score a saved policy on an RL config's eval sets (eval.sets or eval.shards) "
                       "in one process: the run's eval metrics, and every answer")
    p.add_argument("--config", required=True, help="an RL config: its eval, data.media and rollout.engine settings, "
                   "e.g. configs/tiny_demo.yaml")
    p.add_argument("--model", default=None, help="the policy's HF directory, or a LoRA run's PEFT adapter "
                   "directory, e.g. RUN_DIR/final (default: the config's policy.model)")
    p.add_argument("--out", default=None, help="directory for eval.json, answers.jsonl and logs/ (default: "
                   "runs/eval-TIME)")
    p.add_argument("--dp-size", type=int, default=1, help="read each set's prompts as a run of this many DP "
                   "groups did (their shares, together): a run's own eval, reproduced")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. eval.samples=8 eval.temperature=0.6")
    p.set_defaults(func=_eval)

    p = sub.add_parser("export", help="a checkpoint of an RL run as an HF model directory, whatever layout wrote "
                       "it (a LoRA run's as a PEFT adapter); or a LoRA adapter (RUN_DIR/final) merged into its base")
    p.add_argument("adapter", metavar="PATH", help="a checkpoint, RUN_DIR/checkpoints/step_N; or a PEFT LoRA adapter "
                   "directory, e.g. RUN_DIR/final of a run with policy.lora (with --merge)")
    p.add_argument("--merge", action="store_true", help="write the base with W + alpha/r B A on every adapted "
                   "projection (peft's merge_and_unload)")
    p.add_argument("--out", required=True, help="the model's directory (replaced if it exists)")
    p.add_argument("--with-optimizer", action="store_true", help="a checkpoint's optimizer state too, in HF names "
                   "beside the model (OUT/model, OUT/optimizer_*): what a resume at another TP/PP/CP size reads")
    p.add_argument("--base", default=None, help="the base HF directory (default: the adapter's "
                   "base_model_name_or_path)")
    p.set_defaults(func=_export)

    p = sub.add_parser("plot", help="write PNGs of a run: reward curve, phase timeline per rank")
    p.add_argument("run_dir")
    p.set_defaults(func=_plot)

    sub.add_parser("sft", help="supervised fine-tuning of a Megatron vision-language model on WebDataset shards "
                   "(--config C [--nproc N] [--help-config] [key=value ...])")

    p = sub.add_parser("model", help="model tools: parity of the Megatron model with transformers "
                       f"({family_names})")
    msub = p.add_subparsers(dest="model_command", metavar="MODEL_COMMAND", required=True)
    p = msub.add_parser("parity", help="max |logit diff| Megatron vs transformers on text/image/video probes")
    p.add_argument("hf_dir", help="HF model directory (a supported model family's)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (TP x PP > 1 runs under torchrun)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size: the language layers split in stages")
    p.add_argument("--pipeline-layers", default="", help="language layers per stage, e.g. 1,2 (default: even)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (mixture-of-experts models): TP x PP x EP ranks under torchrun")
    p.set_defaults(func=_model_parity)

    p = sub.add_parser("make-tiny-model", help="build a tiny random model offline (cached)")
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    from models.family import tiny_kinds

    p.add_argument("--kind", choices=tiny_kinds(), default="policy")
    p.set_defaults(func=_make_tiny_model)

    from dataio.cli import add_subcommands as add_data_subcommands  # argparse only; heavy imports are lazy

    add_data_subcommands(sub)
    from dataio.prep.cli import add_subcommands as add_prep_subcommands  # argparse only, like `data`

    add_prep_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines drown our progress
    argv = sys.argv[1:] if argv is None else argv
    from yatt_mm.launch import COMMANDS, launch_command  # light: the config loader, no trainer

    if argv and argv[0] in COMMANDS:  # rl, sft: options and key=value overrides in any order
        return launch_command(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    from dataio.storage import RemoteReadError  # light: the standard library only

    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
            RemoteReadError) as e:
        # a path the user gave that is missing, in the way or not allowed (a URL: 403, a store
        # that cannot be reached): our messages name it and the fix, the OS's name the path; a
        # traceback would only bury that (YATT_MM_TRACEBACK=1 keeps it)
        if os.environ.get("YATT_MM_TRACEBACK"):
            raise
        message = str(e).removeprefix(f"{args.command}: ")
        print(f"yatt-mm {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
