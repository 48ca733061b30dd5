"""The entry point that `yatt-mm rl` and `yatt-mm sft` share: parse the command line (options
and `key=value` overrides in any order), load and validate the config, build the tiny or
warm-started models it names, then run in this process or as N ranks under torchrun.

Models are resolved here, before any rank starts, so the ranks only read finished directories
and the core never imports the demo: `tiny:KIND` is the offline tiny model (`models.tiny`),
`warmstart:KIND` the tiny model after its cached SFT on the run's first data directory
(`yatt_mm/demo/warmstart.py`). The resolved config goes to RUN_DIR/config.yaml, which is what
the ranks load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable

from yatt_mm.config import ConfigError, describe, load, save


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(module: str, nproc: int, args: list[str]) -> int:
    """Run `python -m module args` as `nproc` ranks (torchrun --standalone: a free port of its
    own, so several runs can share a machine). Several machines: call torchrun yourself with
    --nnodes/--rdzv-endpoint and the same module."""
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *args]
    return subprocess.call(cmd)


def resolve_model(name: str, data_shards: list[str] | None = None) -> str:
    """A model setting -> an HF directory: builds (or finds cached) `tiny:` and `warmstart:`
    models; anything else must already be an HF directory."""
    if name.startswith("tiny:"):
        from models.tiny import tiny_model_dir

        return str(tiny_model_dir(name.split(":", 1)[1]))
    if name.startswith("warmstart:"):
        from yatt_mm.demo.warmstart import warm_start

        if not data_shards:
            raise ConfigError(f"{name}: a warm start trains on the run's data, but data.shards is empty")
        return str(warm_start(name.split(":", 1)[1], data_shards[0]))
    from models.hf_io import check_hf_dir

    return str(check_hf_dir(name))


def run_command(prog: str, config_cls: type, module: str, run: Callable[[object], int],
                argv: list[str] | None = None) -> int:
    """`prog [--config C] [--nproc N] [--help-config] [key=value ...]`, in any order."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", default=None, help="YAML config, e.g. configs/tiny_demo.yaml")
    parser.add_argument("--nproc", type=int, default=None, help="run as N local ranks under torchrun (DP x TP)")
    parser.add_argument("--help-config", action="store_true", help="list every setting with its default and doc")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. run.steps=5")
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        print("\n".join(describe(config_cls)))
        return 0
    launching = args.nproc is not None and not under_torchrun()
    try:
        cfg = load(config_cls, args.config, args.overrides)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    if not under_torchrun():
        try:
            cfg.check_world(args.nproc if launching else 1)
        except ValueError as e:
            print(f"{prog}: {e}" + ("" if launching else " (start several ranks with --nproc N)"), file=sys.stderr)
            return 2
    try:
        cfg.resolve_models(resolve_model)  # under torchrun without the launcher, every rank (cached, locked)
    except (ConfigError, FileNotFoundError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if not launching:
        return run(cfg)
    path = save(cfg, cfg.fix_run_dir() / "config.yaml")
    return relaunch(module, args.nproc, ["--config", str(path)])
