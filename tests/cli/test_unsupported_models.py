"""A checkpoint yatt-mm cannot train is refused by the commands with one clear line naming what
is wrong, before any work: an HF directory of another model_type names the supported families;
a Qwen3-VL config.json with a setting models/qwen3vl does not compute names the setting. For
`yatt-mm rl` the refusal comes from the launcher (yatt_mm/launch.py: cfg.check_model reads the
spec through the family), so no torchrun and no rank starts: the run directory is never made.
Only config.json is written: the checks read nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yatt_mm.cli import main
from yatt_mm.launch import run_command
from yatt_mm.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]


def _qwen3vl_config() -> dict:
    from models.tiny import tiny_model_dir

    return json.loads((tiny_model_dir("qwen3vl") / "config.json").read_text())


def _other_type(cfg: dict) -> None:
    cfg.clear()
    cfg.update(model_type="llava", architectures=["LlavaForConditionalGeneration"])


# (how the config.json is changed, what the one line must say)
CASES = {
    "llava": (_other_type, "model_type 'llava' is not supported; supported families: Qwen2-VL"),
    "attention_bias": (lambda c: c["text_config"].update(attention_bias=True),
                       "attention_bias true is not implemented"),
    "yarn": (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0),
             "text rope_type 'yarn' is not implemented"),
}


@pytest.fixture(params=sorted(CASES))
def bad_model(request, tmp_path):
    change, message = CASES[request.param]
    cfg = _qwen3vl_config()
    change(cfg)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "model", message


def _one_line(err: str, prog: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: ") and message in lines[0], err
    assert "Traceback" not in err


def test_rl_launcher_refuses_before_any_rank_starts(bad_model, tmp_path, capsys, demo_shards):
    model, message = bad_model
    run_dir = tmp_path / "run"

    def ranks_started(cfg):
        raise AssertionError("the run began with a model it cannot train")

    argv = ["--config", str(ROOT / "configs/tiny_demo.yaml"), "--nproc", "2", f"policy.model={model}",
            "reward.judges=[]", f"run.run_dir={run_dir}", *demo_shards]
    assert run_command("yatt-mm rl", RLConfig, "yatt_mm.rl.train", ranks_started, argv) == 2
    _one_line(capsys.readouterr().err, "yatt-mm rl", message)
    assert not run_dir.exists()  # made (and locked) only on the way to torchrun


def test_plan_refuses_naming_the_setting(bad_model, capsys):
    model, message = bad_model
    assert main(["plan", "--config", str(ROOT / "configs/tiny_demo.yaml"), f"policy.model={model}",
                 "reward.judges=[]"]) == 2
    captured = capsys.readouterr()
    _one_line(captured.err, "yatt-mm plan", message)
    assert captured.out == ""


def test_model_parity_refuses_before_starting_a_parity_run(bad_model):
    model, message = bad_model
    with pytest.raises(SystemExit) as e:  # a string exit code: Python prints it alone, no traceback
        main(["model", "parity", str(model)])
    assert isinstance(e.value.code, str)
    _one_line(e.value.code, "yatt-mm model parity", message)


def test_the_unchanged_qwen3vl_config_passes_the_same_checks(tmp_path, capsys):
    """The refusals come from the changed setting, not from a config.json standing alone."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(_qwen3vl_config()))
    assert main(["plan", "--config", str(ROOT / "configs/tiny_demo.yaml"), f"policy.model={tmp_path / 'model'}",
                 "reward.judges=[]"]) == 0
    assert "verdict: fits" in capsys.readouterr().out
