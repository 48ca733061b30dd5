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
from pathlib import Path
from typing import Callable

from yatt_mm.config import ConfigError, describe, load, save


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(module: str, nproc: int, args: list[str]) -> int:
    """Run `python -m module args` as `nproc` ranks (torchrun --standalone: a free port of its
    own, so several runs can share a machine). Several machines: call torchrun yourself with
    --nnodes/--rdzv-endpoint and the same module. torchrun is told to stop when this process
    dies, however it dies (an OOM killer or a scheduler that kills the parent), and it stops
    its ranks: no orphaned run goes on writing into the run directory."""
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *args]
    return subprocess.call(cmd, preexec_fn=_stop_with_parent)


def _stop_with_parent() -> None:
    """In the child before it starts: SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the child outlives a killed launcher, as without this


def lock_run_dir(run_dir: Path):
    """Hold RUN_DIR/.lock for as long as this process lives (the kernel drops it when the process
    dies, however it dies); a second run on the same directory is refused, naming the live one.
    Returns the open lock file (keep it referenced)."""
    import fcntl
    import json
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "{}"
        f.close()
        raise RunDirBusy(f"run dir {run_dir} is in use by another run: {owner}; wait for it or stop it, "
                         "or give another run directory") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "command": " ".join(sys.argv)[:300]}))
    f.flush()
    return f


class RunDirBusy(RuntimeError):
    pass


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
    run_dir = cfg.fix_run_dir()
    try:
        lock = lock_run_dir(run_dir)
    except RunDirBusy as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    with lock:  # held while the ranks run
        return relaunch(module, args.nproc, ["--config", str(save(cfg, run_dir / "config.yaml"))])
