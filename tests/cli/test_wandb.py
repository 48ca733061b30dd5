"""Weights & Biases beside metrics.jsonl (`metrics.wandb`), without the network: offline runs
read back with wandb's own reader of its .wandb log (`wandb leet inspect`), and the message
when wandb is asked for but not installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from yatt_mm.config import ConfigError, load
from yatt_mm.metrics import WANDB_MISSING, MetricsWriter, Timeline, WandbConfig
from yatt_mm.rl.config import RLConfig
from wandb_offline import assert_holds_metrics_jsonl, offline_env, read_offline_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["policy.model=tiny:policy", "reward.judges=[]"]


def test_an_offline_wandb_run_holds_every_step_the_config_and_the_plots(tmp_path, monkeypatch):
    from yatt_mm.plot import plot_run

    for var, value in offline_env(tmp_path).items():
        monkeypatch.setenv(var, value)
    run_dir = tmp_path / "run"
    cfg = RLConfig()
    cfg.run.steps = 2
    cfg.metrics.wandb = wandb_cfg = WandbConfig(project="yatt-test", mode="offline", tags=["unit"])
    timeline = Timeline(0, run_dir / "timeline_rank0.jsonl")
    m = MetricsWriter(run_dir, 0, tensorboard=False, wandb=wandb_cfg, config=cfg, plots=plot_run)
    m.log(0, {"eval/reward_mean": 0.25})
    for step in (1, 2):
        with timeline.phase("rollout", step - 1):
            pass
        m.log(step, {"rollout/reward_mean": 0.5 * step, "train/loss": 1.0 / step, "time/step": 0.1})
    m.close()

    (folder,) = (run_dir / "wandb").glob("offline-run-*")  # dir defaults to the run directory
    by_step, run = read_offline_run(folder)
    assert_holds_metrics_jsonl(by_step, run_dir)
    assert sorted(by_step) == [0, 1, 2]
    assert run["state"] == "finished" and run["project"] == "yatt-test" and run["name"] == "run"
    assert run["tags"] == ["unit"]
    assert run["config"]["run"]["steps"] == 2 and run["config"]["metrics"]["wandb"]["mode"] == "offline"
    for name in ("reward_curve", "phase_timeline"):  # the PNGs the run's plots wrote, as images
        assert run["summary"][f"plots/{name}"]["_type"] == "image-file"
        assert (folder / "files" / run["summary"][f"plots/{name}"]["path"]).is_file()
        assert (run_dir / f"{name}.png").is_file()

    # the same run directory again (a resumed run): the same W&B run goes on
    again = MetricsWriter(run_dir, 0, tensorboard=False, wandb=wandb_cfg, config=cfg)
    again.log(3, {"rollout/reward_mean": 2.0})
    again.close()
    assert {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")} == {run["run_id"]}


def test_other_ranks_and_default_settings_never_start_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would fail
    for rank, settings in ((1, WandbConfig(project="p", mode="offline")), (0, WandbConfig()),
                           (0, WandbConfig(project="p", mode="disabled"))):
        m = MetricsWriter(tmp_path / f"r{rank}", rank, tensorboard=False, wandb=settings)
        m.log(1, {"a": 1.0})
        m.close()
    with pytest.raises(RuntimeError, match=WANDB_MISSING.replace("[", r"\[")):  # rank 0 under a bare torchrun
        MetricsWriter(tmp_path / "r0", 0, tensorboard=False, wandb=WandbConfig(project="p", mode="offline"))


def test_wandb_asked_for_but_not_installed_fails_before_any_rank_starts(monkeypatch, capsys):
    import yatt_mm.launch as launch

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import both fail
    monkeypatch.setattr(launch, "relaunch", lambda *a, **k: pytest.fail("ranks started"))
    argv = ["--config", "configs/tiny_demo.yaml", "--nproc", "2", *TINY, "metrics.wandb.project=yatt"]
    assert launch.run_command("yatt-mm rl", RLConfig, "m", lambda cfg: pytest.fail("ran"), argv) == 2
    assert f"yatt-mm rl: {WANDB_MISSING}" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("metrics.wandb.mode=cloud", "metrics.wandb.mode: 'cloud' is not one of 'online', 'offline', 'disabled'"),
    ("metrics.wandb.name=x", "metrics.wandb: W&B settings are given but project is empty"),
])
def test_bad_wandb_settings_fail_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load(RLConfig, ROOT / "configs/tiny_demo.yaml", [override])


def test_wandb_settings_load():
    cfg = load(RLConfig, ROOT / "configs/tiny_demo.yaml",
               ["metrics.wandb.project=yatt", "metrics.wandb.mode=offline", "metrics.wandb.tags=[a, b]"])
    assert cfg.metrics.wandb.enabled and cfg.metrics.wandb.tags == ["a", "b"] and cfg.metrics.tensorboard
    assert not RLConfig().metrics.wandb.enabled  # off by default
