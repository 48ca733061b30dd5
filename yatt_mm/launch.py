"""The entry point that `yatt-mm rl` and `yatt-mm sft` share: parse the command line (options
and `key=value` overrides in any order), load and validate the config, build the tiny or
warm-started models it names, then run in this process or as N ranks under torchrun.

Models are resolved here, before any rank starts, so the ranks only read finished directories
and the core never imports the demo: `tiny:KIND` is the offline tiny model (`models.tiny`),
`warmstart:KIND` the tiny model after its cached SFT on the run's first data directory
(`yatt_mm/demo/warmstart.py`). The resolved config goes to RUN_DIR/config.yaml, which is what
the ranks load.

Each rank sends its libraries' log lines to RUN_DIR/logs/rankR.log (`route_logs`): the terminal
shows the command's own progress; `--verbose` shows the libraries' lines there too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from yatt_mm.config import ConfigError, describe, load, markdown, save


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


VERBOSE_ENV = "YATT_MM_VERBOSE"  # --verbose sets it; the ranks (torchrun's children) inherit it
OWN_PACKAGES = {"yatt_mm", "models", "dataio", "__main__"}


def route_logs(run_dir: str | Path, rank: int) -> Path:
    """Where this process's log lines go; a rank calls it first, before vLLM is imported.

    The libraries' records (vLLM, Megatron, torch, transformers, at INFO and up) and Python
    warnings go to RUN_DIR/logs/rank{rank}.log. The terminal (stderr) gets this project's warnings
    and the libraries' errors, each distinct message once; with --verbose (YATT_MM_VERBOSE=1), every
    line the file gets. The commands print their progress themselves (stdout), which this leaves
    alone. Returns the log file."""
    import logging

    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "yatt_mm", False)]:  # a second call replaces the first
        root.removeHandler(old)
        old.close()
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.INFO if verbose else logging.WARNING)
    to_terminal.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
    if not verbose:
        to_terminal.addFilter(_OwnWarningsAndLibraryErrorsOnce())
    for handler in (to_file, to_terminal):
        handler.yatt_mm = True
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger (each still once per call site)
    # vLLM and transformers give their loggers a stream handler of their own and stop propagation;
    # both let them propagate to the handlers above instead. vLLM reads this when it is imported
    # and at every engine start (a user's own VLLM_CONFIGURE_LOGGING=1 keeps vLLM's handler).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if os.environ["VLLM_CONFIGURE_LOGGING"] == "0":
        vllm_logger = logging.getLogger("vllm")
        for handler in list(vllm_logger.handlers):  # vLLM imported already: undo what it set up
            vllm_logger.removeHandler(handler)
        vllm_logger.propagate = True
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        pass
    else:
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    _log_uncaught_to(to_file)
    if rank == 0:
        print(f"library logs (vLLM, Megatron, torch, transformers): {path.parent}/rank*.log"
              + ("" if verbose else " (--verbose: here too)"), flush=True)
    return path


_uncaught_handler = None  # the newest route_logs file handler, where the hooks below write


def _log_uncaught_to(handler) -> None:
    """The exception that ends this process (or one of its threads) goes to the rank's log file
    too, beside the library lines that led to it: the terminal's copy (Python's own report, which
    still follows) is often cut off by the launcher's summary or a test's capture."""
    import logging
    import threading

    global _uncaught_handler
    installed, _uncaught_handler = _uncaught_handler is not None, handler
    if installed:
        return

    def log(kind, value, tb, where: str) -> None:
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
            _uncaught_handler.handle(logging.LogRecord("yatt_mm", logging.ERROR, __file__, 0,
                                                       "uncaught exception in %s", (where,), (kind, value, tb)))

    def process_hook(kind, value, tb, previous=sys.excepthook) -> None:
        log(kind, value, tb, "the main thread")
        previous(kind, value, tb)

    def thread_hook(args, previous=threading.excepthook) -> None:
        log(args.exc_type, args.exc_value, args.exc_traceback, f"thread {args.thread.name if args.thread else '?'}")
        previous(args)

    sys.excepthook, threading.excepthook = process_hook, thread_hook


class _OwnWarningsAndLibraryErrorsOnce:
    """The terminal's filter: this project's records, and the libraries' errors; each once."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()

    def filter(self, record) -> bool:
        import logging

        if record.levelno < logging.ERROR and record.name.split(".")[0] not in OWN_PACKAGES:
            return False
        key = (record.name, record.levelno, str(record.msg))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@dataclass
class Nodes:
    """Where this launcher sits in a job of several machines (torchrun's static rendezvous: node
    0's address and a port every node can reach). One node: torchrun --standalone."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def torchrun(self) -> list[str]:
        """torchrun's command line up to the per-node options. One node: torchrun with a
        rendezvous store of its own on a free port of 127.0.0.1 (several runs can share a
        machine; nothing on the network reaches it: yatt_mm/loopback.py). Several: torchrun's
        static rendezvous at node 0's address, which every node must reach."""
        if self.nnodes == 1:
            from yatt_mm.loopback import torchrun_args

            return [sys.executable, "-m", "yatt_mm.loopback", *torchrun_args()]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes), "--node-rank",
                str(self.node_rank), "--master-addr", self.master_addr, "--master-port", str(self.master_port)]


# What every rank's environment gets on CPU unless the user's sets it. OMP_WAIT_POLICY=PASSIVE: an
# OpenMP thread that waits for work sleeps at once instead of spinning first (libgomp's default).
# With torch's 2 threads on 2 cores (one rank: --nproc 1) and the cores shared with other work, a
# spinning thread holds a core its descheduled peer needs. Paired runs, `yatt-mm rl --nproc 1` on
# the 2-core CPU machine (benchmarks/bench_rl_vs_trl.py's work): tiny model under load 0.40/0.45/
# 0.40 s per step against 0.56/0.73/0.44 s spinning, the whole run 26 s against 52-70 s; 4x256
# model, 64-token answers, under load median 0.93x over 5 rounds; on a quiet machine level (tiny
# 0.96x/1.07x, 4x256 0.93x/0.95x). With --nproc > 1 a rank has 1 thread by default: no change.
# A CPU setting (on a GPU the cores feed the device, and nothing here was measured there): applied
# only where no GPU is present, like the rest of the CPU runtime layer.
CPU_RANK_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path's 108, less the final NUL)
VLLM_SOCKET_NAME = len("/") + 36  # vLLM names its IPC sockets TMPDIR/<uuid4>


def torch_compile_cache_dir() -> str:
    """torch's default compile-cache folder, as torch/_inductor/runtime/cache_dir_utils.py's
    default_cache_dir names it, computed here: importing that module imports torch._inductor and
    torch._dynamo, which took a one-rank launcher from 1.2 to 1.8 s of a core
    (tests/cli/test_runtime_and_cli.py checks that the two names agree)."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def relaunch(module: str, nproc: int, args: list[str], nodes: Nodes | None = None) -> int:
    """Run `python -m module args` as `nproc` ranks on this node (of `nodes`). torchrun is told to
    stop when this process dies, however it dies (an OOM killer or a scheduler that kills the
    parent), and it stops its ranks: no orphaned run goes on writing into the run directory.
    A one-node run's ranks listen on loopback only (yatt_mm/loopback.py)."""
    import signal

    from models.runtime import has_gpu
    from yatt_mm.loopback import one_node_env
    from yatt_mm.processes import die_with_parent

    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    nodes = nodes or Nodes()
    cmd = [*nodes.torchrun(), "--nproc-per-node", str(nproc), "-m", module, *args]
    env = {**({} if has_gpu() else CPU_RANK_ENV_DEFAULTS), **os.environ}
    if nproc > 1:  # what torchrun sets itself when it is unset, less the 4-line banner it prints about it
        env.setdefault("OMP_NUM_THREADS", "1")
    if nodes.nnodes == 1:
        env.update(one_node_env(env))
    launcher = os.getpid()
    # The ranks' temporary files go in a folder of this launch's own, removed once torchrun has
    # ended: torchrun leaves a log folder in the system's temporary directory at every launch;
    # vLLM its IPC sockets and distributed-init files, and W&B its media folders, whenever a rank
    # dies; a served adapter's folder goes with its process only if that process exits. The
    # folder is made inside the caller's TMPDIR: a run still writes where its user pointed
    # temporary files. Only a kill -9 of the launcher itself leaves it behind. In a TMPDIR too long
    # for one more folder before vLLM's socket names, the ranks keep the caller's TMPDIR (and
    # leave what they did).
    # torch's compile cache stays where torch puts it by default (in the caller's TMPDIR): a cache
    # is meant to outlive the run.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", torch_compile_cache_dir())
    with tempfile.TemporaryDirectory(prefix="yatt-mm-", ignore_cleanup_errors=True) as scratch:
        fits = len(scratch) + VLLM_SOCKET_NAME <= SOCKET_PATH_MAX
        ranks_env = {**env, "TMPDIR": scratch} if fits else env
        # the launcher's main thread starts torchrun and waits for it: SIGTERM when the launcher dies
        return subprocess.call(cmd, preexec_fn=lambda: die_with_parent(signal.SIGTERM, launcher), env=ranks_env)


def lock_run_dir(run_dir: Path, node_rank: int = 0):
    """Hold RUN_DIR/.lock (node 0; other nodes of the job: .lock.nodeR) for as long as this process
    lives (the kernel drops it when the process dies, however it dies); a second run on the same
    directory is refused, naming the live one. Returns the open lock file (keep it referenced)."""
    import fcntl
    import json
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / (".lock" if node_rank == 0 else f".lock.node{node_rank}"), "a+")
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


def cluster_mismatch(cluster, nproc: int, nnodes: int, config: str | None = None) -> str:
    """How this launch's shape (--nproc ranks on each of --nnodes nodes) differs from the cluster
    the config states (its `cluster` section, RL's ClusterConfig; figures not stated never
    differ), in words naming the plan to make instead; empty when nothing differs."""
    stated = cluster.stated() if cluster is not None else {}
    # each figure: this launch's value, the launcher's flag for it, `yatt-mm plan`'s flag for it
    shape = {"nodes": (nnodes, "--nnodes", "--nodes"), "gpus_per_node": (nproc, "--nproc", "--gpus-per-node")}
    differ = {name: shape[name] for name in shape if name in stated and stated[name] != shape[name][0]}
    if not differ:
        return ""
    written = ", ".join(f"cluster.{name}={stated[name]}" for name in differ)
    launched = ", ".join(f"{flag} {value}" for value, flag, _ in differ.values())
    plan_flags = " ".join(f"{plan_flag} {value}" for value, _, plan_flag in differ.values())
    return (f"the config is written for {written}; this launch has {launched}: its memory plan is for the "
            f"stated cluster (plan this one: yatt-mm plan --config {config or 'CONFIG'} {plan_flags})")


@dataclass(frozen=True)
class Example:
    """How `yatt-mm rl --help` (or `sft`) shows to try the command on this CPU: the command that
    makes the data the config reads, then a run of a config of this repository with an override
    of a setting that config has (tests/cli/test_help_examples.py loads each)."""

    prepare: str
    config: str
    override: str
    nproc: int | None = None

    def command(self, prog: str) -> str:
        nproc = f" --nproc {self.nproc}" if self.nproc else ""
        return f"{prog} --config {self.config}{nproc} {self.override}"


# The two commands' configs differ in shape (SFT's steps is top level, RL's is run.steps): each
# shows its own config and one of its own settings.
EXAMPLES = {
    "yatt-mm rl": Example("yatt-mm demo --data-only", "configs/tiny_demo.yaml", "run.steps=5", nproc=2),
    "yatt-mm sft": Example("yatt-mm data synth data/synth --images 400 --videos 0", "configs/tiny_sft.yaml",
                           "steps=5"),
}


def command_parser(prog: str) -> argparse.ArgumentParser:
    """The options of `prog` (yatt-mm rl or sft); the example of EXAMPLES[prog] in its help."""
    example = EXAMPLES.get(prog)
    epilog = (f"example (tiny model, CPU; the first command makes the data the config reads):\n"
              f"  {example.prepare}\n  {example.command(prog)}") if example else None
    parser = argparse.ArgumentParser(prog=prog, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML config" + (f", e.g. {example.config}" if example else ""))
    parser.add_argument("--nproc", type=int, default=None, help="run as N local ranks under torchrun (DP x TP)")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the job (each runs this command)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 .. nnodes-1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, reachable from every node")
    parser.add_argument("--master-port", type=int, default=29500, help="a free port on node 0")
    parser.add_argument("--help-config", action="store_true",
                        help="list every setting, one a line: type, allowed values, default, doc")
    parser.add_argument("--markdown", action="store_true",
                        help="with --help-config: a Markdown table, as in docs/reference/config.md")
    parser.add_argument("--verbose", action="store_true", help="the libraries' log lines (vLLM, Megatron, torch, "
                        "transformers) on the terminal too, not only in RUN_DIR/logs/")
    parser.add_argument("overrides", nargs="*",
                        help="key=value settings" + (f", e.g. {example.override}" if example else ""))
    return parser


def run_command(prog: str, config_cls: type, module: str, run: Callable[[object], int],
                argv: list[str] | None = None) -> int:
    """`prog [--config C] [--nproc N] [--help-config [--markdown]] [key=value ...]`, in any order."""
    parser = command_parser(prog)
    args = parser.parse_intermixed_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # for route_logs, here and in the ranks and warm starts this starts
    if args.markdown and not args.help_config:
        parser.error("--markdown goes with --help-config")
    if args.help_config:
        print(markdown(config_cls, f"`{prog}`") if args.markdown else "\n".join(describe(config_cls)))
        return 0
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if nodes.nnodes > 1 and args.nproc is None:
        args.nproc = 1
    if not 0 <= nodes.node_rank < nodes.nnodes:
        print(f"{prog}: --node-rank must be in 0..{nodes.nnodes - 1}, got {nodes.node_rank}", file=sys.stderr)
        return 2
    launching = args.nproc is not None and not under_torchrun()
    try:
        cfg = load(config_cls, args.config, args.overrides)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    if not under_torchrun():
        try:  # optional packages the settings ask for (metrics.wandb: wandb), before any rank starts
            if (metrics := getattr(cfg, "metrics", None)) is not None:
                metrics.check_installed()
        except RuntimeError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return 2
        if launching and (mismatch := cluster_mismatch(getattr(cfg, "cluster", None), args.nproc, nodes.nnodes,
                                                         args.config)):
            # a note, not a refusal: a recipe may run on another cluster (its layout still has to
            # divide the world, checked next); the user learns the plan was made for another
            print(f"{prog}: note: {mismatch}", file=sys.stderr)
        try:
            cfg.check_world(args.nproc * nodes.nnodes if launching else 1)
        except ValueError as e:
            print(f"{prog}: {e}" + ("" if launching else " (start several ranks with --nproc N)"), file=sys.stderr)
            return 2
        try:  # the data the run reads, before a warm start trains on it or a rank loads a model
            cfg.check_inputs()  # local paths, and URLs: missing, empty, no bucket, 403, unreachable
        except (OSError, ValueError) as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return 2
    try:
        cfg.resolve_models(resolve_model)  # under torchrun without the launcher, every rank (cached, locked)
        cfg.check_model()
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if not launching:
        return run(cfg)
    if nodes.nnodes > 1 and not (getattr(cfg, "run_dir", "") or getattr(getattr(cfg, "run", None), "run_dir", "")):
        print(f"{prog}: a job on {nodes.nnodes} nodes needs an explicit run directory on storage every node sees "
              "(run.run_dir=... for rl, run_dir=... for sft)", file=sys.stderr)
        return 2
    run_dir = cfg.fix_run_dir()
    try:
        lock = lock_run_dir(run_dir, nodes.node_rank)
    except RunDirBusy as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    with lock:  # held while the ranks run
        # run_dir must be storage every node sees; each node's launcher writes the same file, atomically
        return relaunch(module, args.nproc, ["--config", str(save(cfg, run_dir / "config.yaml"))], nodes)


# `yatt-mm rl` and `sft`: the config's module and class, and the module and function every rank
# runs. The launcher imports only the config's module: loading, checking or listing a config
# imports no Megatron or vLLM (seconds on two cores); the ranks import them, or this process when
# the job runs in it.
COMMANDS = {"rl": ("yatt_mm.rl.config", "RLConfig", "yatt_mm.rl.train", "train"),
            "sft": ("yatt_mm.sft.config", "SFTConfig", "yatt_mm.sft.train", "run_and_report")}


def launch_command(command: str, argv: list[str]) -> int:
    """`yatt-mm COMMAND ARGV` for COMMAND in COMMANDS (run_command's options)."""
    config_module, config_name, module, function = COMMANDS[command]
    config_cls = getattr(importlib.import_module(config_module), config_name)
    run = lambda cfg: getattr(importlib.import_module(module), function)(cfg)  # noqa: E731
    return run_command(f"yatt-mm {command}", config_cls, module, run, argv)
