import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from models import runtime
from yatt_mm.cli import build_parser


def test_torchvision_imports_and_transforms_work():
    import torch
    from torchvision.transforms import v2

    out = v2.Resize((28, 56))(torch.zeros(3, 10, 10))
    assert out.shape == (3, 28, 56)
    runtime.fix_torchvision_ops()  # idempotent: a second call changes nothing
    assert runtime._torchvision_ops_defined()


def test_fresh_process_gets_the_fix_without_importing_yatt_mm():
    # vLLM inspects models in such a subprocess; only the .pth hook can reach it
    code = "import torchvision, transformers.processing_utils; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(sysconfig.get_paths()["purelib"], "yatt_mm_runtime.pth").is_file()


def test_a_gpu_process_gets_the_fallbacks_for_missing_kernels_and_no_cpu_shim():
    """Where a GPU is present (made to look so before megatron.core is imported), the CPU shims
    stay off but Megatron still gets its pure-torch paths for a missing Transformer Engine (the
    MoE router's te_general_gemm: NameError on the first GPU run) and fla (Qwen3.5's DeltaNet:
    ImportError there)."""
    code = """
import torch
from models import runtime
runtime.has_gpu = lambda: True
device = torch.cuda.current_device
import megatron.core
from megatron.core.ssm import gated_delta_net
from megatron.core.transformer.moe import moe_utils
print(torch.cuda.current_device is device, moe_utils.te_general_gemm is None,
      gated_delta_net.chunk_gated_delta_rule is gated_delta_net.torch_chunk_gated_delta_rule)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"], out.stdout


def test_help_lists_commands_and_every_model_family():
    from models.family import families

    help_text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    for command in ("demo", "doctor", "rl", "sft", "make-tiny-model", "prep"):
        assert f" {command} " in help_text
    for family in families():  # the help must not go stale as families are added
        assert family.name in help_text, family.name


def test_the_demo_reads_its_results_where_the_run_wrote_them():
    """`yatt-mm demo run.run_dir=D` trained into D but then plotted the default directory and
    exited 2; the demo now follows the override (the RL run's last one wins), else --run-dir."""
    from yatt_mm.demo import demo_run_dir

    assert str(demo_run_dir(None, ["run.steps=2", "run.run_dir=/tmp/a"])) == "/tmp/a"
    assert str(demo_run_dir("/tmp/b", ["run.run_dir=/tmp/a", "run.run_dir=/tmp/c"])) == "/tmp/c"
    assert str(demo_run_dir("/tmp/b", ["run.steps=2"])) == "/tmp/b"
    assert demo_run_dir(None, None).name.startswith("tiny-demo-")


def test_a_missing_or_occupied_path_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """The commands' path errors name the path and the fix; no traceback buries them."""
    from yatt_mm.cli import main

    monkeypatch.delenv("YATT_MM_TRACEBACK", raising=False)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    cases = {("data", "index", str(tmp_path / "nope")): "yatt-mm data: data shards: ",
             ("prep", "video", str(tmp_path / "nope"), "--out", str(tmp_path / "out")): "yatt-mm prep: input ",
             ("plot", str(tmp_path)): "metrics.jsonl is missing or empty",
             ("make-tiny-model", str(occupied)): "pick an empty or new directory"}
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert (occupied / "notes.txt").read_text() == "mine"
    monkeypatch.setenv("YATT_MM_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        main(["plot", str(tmp_path)])


def test_doctor_static_checks_pass(capsys):
    from yatt_mm.doctor import run_doctor

    assert run_doctor(live=False) == 0
    out = capsys.readouterr().out
    assert "[PASS] torch==2.13.0" in out and "FAIL" not in out


def test_doctor_live_megatron_check_passes():
    """The live Megatron check in its own process (a one-rank gloo group, forward and backward)."""
    proc = subprocess.run([sys.executable, "-m", "yatt_mm.doctor", "megatron"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT Megatron-Core GPT forward/backward on CPU" in proc.stdout
    # every command on CPU: Megatron's "Transformer Engine and Apex are not installed" (expected
    # without CUDA) and its own cuda_graph_scope deprecation are silenced (models/runtime.py)
    assert "not installed" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr[-3000:]


_ROUTED = """
import logging, sys, warnings
from yatt_mm.launch import route_logs
route_logs(sys.argv[1], 0)
for _ in range(2):
    logging.getLogger("vllm.worker").warning("a library warning")
    logging.getLogger("megatron.core").error("a library error")
logging.getLogger("yatt_mm.rl").warning("our own warning")
warnings.warn("a python warning")
print("our progress")
if len(sys.argv) > 2:  # the rank fails: in a thread, then in the main thread
    import threading
    route_logs(sys.argv[1], 0)  # a second call (a warm start's): the hooks still log each failure once
    thread = threading.Thread(target=lambda: 1 / 0, name="reader")
    thread.start(); thread.join()
    raise RuntimeError("the rank's own failure")
"""


def test_library_logs_go_to_the_run_dir_and_verbose_brings_them_back(tmp_path):
    """A rank's libraries log to RUN_DIR/logs/rank0.log; the terminal keeps our own lines and the
    libraries' errors, each once; --verbose (YATT_MM_VERBOSE=1) shows every line there too."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "YATT_MM_VERBOSE"}
    quiet = subprocess.run([sys.executable, "-c", _ROUTED, str(tmp_path / "q")], capture_output=True, text=True,
                           timeout=120, env=env)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "our progress" in quiet.stdout and f"{tmp_path / 'q' / 'logs'}/rank*.log" in quiet.stdout
    assert quiet.stderr.count("a library error") == 1 and quiet.stderr.count("our own warning") == 1
    assert "a library warning" not in quiet.stderr and "a python warning" not in quiet.stderr
    log = (tmp_path / "q" / "logs" / "rank0.log").read_text()
    assert log.count("WARNING vllm.worker: a library warning") == 2 and log.count("a library error") == 2
    assert "py.warnings" in log and "a python warning" in log
    loud = subprocess.run([sys.executable, "-c", _ROUTED, str(tmp_path / "v")], capture_output=True, text=True,
                          timeout=120, env={**env, "YATT_MM_VERBOSE": "1"})
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert loud.stderr.count("a library warning") == 2 and "a python warning" in loud.stderr
    # a rank's failure: its traceback in its log file beside the library lines, and still on the terminal
    failed = subprocess.run([sys.executable, "-c", _ROUTED, str(tmp_path / "f"), "fail"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert failed.returncode == 1 and "RuntimeError: the rank's own failure" in failed.stderr, failed.stderr[-2000:]
    log = (tmp_path / "f" / "logs" / "rank0.log").read_text()
    assert log.count("ERROR yatt_mm: uncaught exception in the main thread") == 1, log
    assert log.count("ERROR yatt_mm: uncaught exception in thread reader") == 1, log
    assert "ZeroDivisionError" in log and "RuntimeError: the rank's own failure" in log, log


def test_demo_data_only_makes_the_tiny_configs_shards_once_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """configs/tiny_tools.yaml and the other tiny configs read runs/demo-data: `yatt-mm demo
    --data-only` makes it without the demo's warm starts and run."""
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["demo", "--data-only"])
    assert args.func(args) == 0
    assert len(list((tmp_path / "runs/demo-data/train").glob("*.tar"))) == 4
    assert len(list((tmp_path / "runs/demo-data/eval").glob("*.tar"))) == 1
    assert "512 synthetic colour questions" in capsys.readouterr().out
    assert args.func(args) == 0 and capsys.readouterr().out == ""  # made once
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["demo-data"]  # no run directory


def test_the_launcher_names_torchs_compile_cache_as_torch_does_without_importing_it(monkeypatch, tmp_path):
    """The ranks' TORCHINDUCTOR_CACHE_DIR (yatt_mm/launch.py) is torch's own default folder, for
    any TMPDIR and user name, and the launcher's process never imports torch._inductor for it."""
    import subprocess
    import sys

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from yatt_mm.launch import torch_compile_cache_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    for user in ("alice", "dom\\\\ain/bob:x"):
        monkeypatch.setenv("USER", user)
        monkeypatch.setenv("LOGNAME", user)
        assert torch_compile_cache_dir() == default_cache_dir(), user
    probe = ("import sys, yatt_mm.launch as l; l.torch_compile_cache_dir(); "
             "print('torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
