"""On-policy distillation in partial colocation, end to end: `yatt-mm rl` on 2 ranks with the
teacher as a vLLM server per node (started by the first controller, both controllers streaming
their responses to it as they finish); its API process killed (kill -9, as a crash would) once
step 1 is logged. The run finishes every step: the responses after the kill go unscored, counted
by reason, and the server's processes end with the run."""

import subprocess
import time

import pytest

from dataio.synth import write_shards
from test_rl import ROOT, _steps, _steps_logged, _tiny_rl, _wait_for


def _teacher_api(teacher: str):
    """The teacher server's API process (the supervisor's child; vLLM's EngineCore under it)."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and teacher in cmd and "teacher" in cmd:
            return p
    return None


@pytest.mark.slow  # a teacher server start (20-60 s) and a 4-step run
def test_a_teacher_server_killed_mid_run_is_counted_and_the_run_finishes(tmp_path, warm_policy):
    import psutil

    write_shards(str(tmp_path / "train"), images=16, videos=0, samples_per_shard=8, seed=7, tasks=["colour"])
    run_dir = tmp_path / "run"
    cmd = _tiny_rl(run_dir, tmp_path / "train", "eval.every=0", "reward.judges=[]", "run.steps=4",
                   "run.save_final=false", "run.placement=partial", "dynamic_sampling.enabled=false",
                   f"algorithm.distill.teacher={warm_policy}", "algorithm.distill.backend=server",
                   "algorithm.distill.timeout_s=10", "algorithm.distill.retries=1", "algorithm.distill.backoff_s=0.1",
                   policy=warm_policy)
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, launcher, "step 1")
        api = _teacher_api(str(warm_policy))
        assert api is not None, "no teacher server process found"
        server = [api, *api.children(recursive=True)]
        api.kill()
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-5000:]
    assert "teacher: vLLM server at" in out
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["distill/scored_fraction"] == 1.0 and steps[0]["distill/teacher/fallback"] == 0.0
    last = steps[-1]  # after the kill (a step in flight then may have been scored in part)
    assert last["distill/scored_fraction"] == 0.0, last
    assert last["distill/teacher/fallback"] > 0 and last["distill/teacher/fallback"] == \
        last["distill/teacher/fallback_unreachable"], last
    assert last["distill/teacher/scored"] >= steps[0]["distill/teacher/scored"] > 0  # running counts, summed over ranks
    time.sleep(1)
    assert not [p for p in server if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert _teacher_api(str(warm_policy)) is None  # nothing of the server outlives the run
