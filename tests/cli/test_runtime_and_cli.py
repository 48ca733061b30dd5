import subprocess
import sys
import sysconfig
from pathlib import Path

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


def test_help_lists_commands():
    help_text = build_parser().format_help()
    for command in ("demo", "doctor", "make-tiny-model"):
        assert command in help_text


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
