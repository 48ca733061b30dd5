"""Asynchronous RL with bounded staleness (run.max_staleness = k >= 1): while step n trains, each
controller generates, scores and builds step n+1's samples, with the weights step n started from.

Where the rollout runs: a thread of the controller's own rank process drives it (reads the
data, builds the requests and the training samples, runs dynamic sampling), while the vLLM work,
the rollout engine and the in-process judges, runs in the controller's engine worker, a process
of its own (placement `disaggregated`; yatt_mm/engines/worker.py). The thread mostly waits on the
worker's pipe, so the GIL no longer serialises vLLM's scheduler with Megatron's step; the media
go only from the rank that read them to its own worker, and the controllers stay as parallel as
before (each leader runs its own thread; no collective is called from it). New weights go to the
worker between steps over its weights group (gloo on CPU; NCCL on GPUs, where the worker has
GPUs of its own: run.rollout_devices; not run on a GPU yet).

What it gains depends on idle devices: on GPUs the rollout's devices idle while the trainer's
train, and the other way round, which the overlap fills. A CPU machine whose synchronous step
already keeps every core busy has nothing to fill: there the two sides only share the cores
(benchmarks/bench_async.py measures the cores' utilisation of the synchronous step, the bound).

One step's order on a controller (rl/step.py):

    take(n): the samples generated during step n-1 (at the first step, or after a resume:
             generated now), the data position and lineage as of them, then step n+1's rollout
             starts in the thread
    logprobs, train                                  <- the thread generates meanwhile
    wait():  the thread's rollout ends; the engine is idle
    sync:    new weights into the engine (the rollout never sees a half-loaded model)

So a sample is trained by weights one version newer than those that sampled it (staleness 1),
and the rollout pauses only for the weight copy. Larger k lets dynamic sampling's buffer hand
older groups to later steps; anything more than k versions older is dropped and counted
(`rollout/stale_dropped`), never trained; `rollout/staleness_mean`/`_max` are logged. The loss
corrects for the older behaviour policy through vLLM's logprobs (algorithm.rollout_correction):
the trainer's old logprobs are those of the weights that train, vLLM's those that sampled.

Exactly once: a checkpoint of step n holds the data position and sampler state taken in
`take(n)`, before step n+1's rollout drew its prompts, and the lineage of step n lists only what
step n trained. A restart from it generates step n+1's prompts again, from the same position:
nothing lost, nothing doubled.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from yatt_mm.rl.checkpoint_state import controller_state
from yatt_mm.rl.distributed import sum_across
from yatt_mm.rl.stats import summed_metrics
from yatt_mm.rl.sources import Consumed


class RolloutAhead:
    """One controller's rollout, one step ahead of its training, driven from a thread of its
    process; the step's calls as rl/rollouts.py lists them."""

    def __init__(self, run):
        self.run = run
        self.controller, self.engine, cfg = run.controller, run.engine, run.cfg
        self.prompts_per_step, self.steps, self.checkpoint_every = (cfg.rollout.prompts_per_step, cfg.run.steps,
                                                                    cfg.run.checkpoint_every)
        self.max_staleness, self.partial = cfg.run.max_staleness, cfg.run.partial_rollout
        self._thread: threading.Thread | None = None
        self._ahead: tuple[int, tuple | None, BaseException | None] | None = None  # (step, result, error)
        self.consumed: list[Consumed] = []  # the lineage of the step being trained
        self.snapshot = None  # the controller's state as of that step, when it checkpoints

    def take(self, step: int) -> tuple[list, dict[str, float]]:
        """Step `step`'s groups (generated ahead, else now) and their rollout and staleness
        metrics. Then starts the next step's rollout."""
        groups, rollout = self._take(step)
        rollout, metrics = summed_metrics(self.run, rollout)
        metrics |= staleness_metrics(groups, step, self.max_staleness, rollout.stale_dropped, self.run.ranks.leaders_cpu)
        if self.partial:  # generated responses that took new weights mid-generation
            metrics["rollout/partial_responses"] = rollout.partial / max(rollout.responses, 1.0)
        return groups, metrics

    def before_sync(self, step: int) -> None:
        """Without partial rollout, new weights load into an idle engine: the rollout ahead ends first."""
        if not self.partial:
            with self.run.timeline.phase("wait_rollout", step):
                self.wait()

    def during_sync(self, step: int) -> None:
        """With partial rollout the weights went into the generation in flight (between two engine
        steps); it ends before the lineage, the checkpoint, the probe and the eval."""
        if self.partial:
            with self.run.timeline.phase("wait_rollout", step):
                self.wait()

    def _take(self, step: int):
        self.wait()
        if self._ahead is not None and self._ahead[0] == step:
            _, result, error = self._ahead
            if error is not None:
                raise RuntimeError(f"the rollout of step {step + 1}, generated ahead, failed: {error}") from error
        else:  # nothing ahead: the run's first step, or the first after a resume
            with self.engine.lead():
                result = self.controller.step(step, self.prompts_per_step)
        self._ahead = None
        # what this step trains, taken before the next rollout draws more prompts
        self.consumed = self.controller.source.drain_consumed()
        checkpoints = self.checkpoint_every and (step + 1) % self.checkpoint_every == 0
        self.snapshot = controller_state(self.controller) if checkpoints else None
        if step + 1 < self.steps:
            self._thread = threading.Thread(target=self._generate, args=(step + 1,), name=f"rollout-step{step + 1}",
                                            daemon=True)
            self._thread.start()
        return result

    def wait(self) -> None:
        """Until the rollout running ahead has ended: the engine is idle after this."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _generate(self, step: int) -> None:
        try:
            self._ahead = (step, self.controller.step(step, self.prompts_per_step), None)
        except BaseException as e:  # re-raised in the loop, by take()
            self._ahead = (step, None, e)

    def write_lineage(self, path, step: int) -> None:
        self.controller.source.write_lineage(path, step, self.consumed)


def staleness_metrics(groups, step: int, max_staleness: int, dropped: float, leaders) -> dict[str, float]:
    """How many policy versions each sample trained at `step` is behind the weights that train it,
    over every DP group (collectives over the leaders). The sampler already dropped what is
    staler than the bound; a sample beyond it here is a bug, and stops the run before training."""
    ages = [step - s.version for g in groups for s in g]
    if any(a > max_staleness for a in ages):
        raise RuntimeError(f"step {step + 1} would train samples {max(ages)} policy versions old, above "
                           f"run.max_staleness={max_staleness}")
    sums = sum_across({"ages": float(sum(ages)), "samples": float(len(ages))}, leaders)
    peak = sum_across({"max": float(max(ages, default=0))}, leaders, op=dist.ReduceOp.MAX)
    return {"rollout/staleness_mean": sums["ages"] / max(sums["samples"], 1.0), "rollout/staleness_max": peak["max"],
            "rollout/stale_dropped": dropped}
