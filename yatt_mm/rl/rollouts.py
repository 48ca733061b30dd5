"""Where a step's samples come from, chosen once per run (`rollout_for`):

    RolloutNow    generates them inside the step (run.max_staleness = 0, and on every rank that
                  is not a controller)
    RolloutAhead  takes those its thread generated while the previous step trained
                  (run.max_staleness >= 1; rl/rollout_ahead.py)

Both answer rl/step.py's calls in the step's order: `take` (a controller's groups and rollout
metrics), `before_sync` (the engine is idle before new weights load into it), `during_sync`
(after the weights went in, before the lineage and the checkpoint), `write_lineage`, and
`snapshot` (the controller's state a checkpoint saves; None: as it is now).
"""

from __future__ import annotations

from yatt_mm.rl.stats import summed_metrics


class RolloutNow:
    """The synchronous step: the controller generates, scores and builds this step's samples now."""

    snapshot = None

    def __init__(self, run):
        self.run = run

    def take(self, step: int) -> tuple[list, dict[str, float]]:
        run = self.run
        with run.engine.lead():
            groups, rollout = run.controller.step(step, run.cfg.rollout.prompts_per_step)
        return groups, summed_metrics(run, rollout)[1]

    def before_sync(self, step: int) -> None:
        pass  # nothing generates between steps

    def during_sync(self, step: int) -> None:
        pass

    def write_lineage(self, path, step: int) -> None:
        self.run.controller.source.write_lineage(path, step)


def rollout_for(run):
    """A controller of a run with run.max_staleness >= 1 takes its samples from the rollout
    running ahead; every other rank (and every synchronous run) generates in the step."""
    if run.cfg.run.max_staleness and run.ranks.leader:
        from yatt_mm.rl.rollout_ahead import RolloutAhead

        return RolloutAhead(run)
    return RolloutNow(run)
