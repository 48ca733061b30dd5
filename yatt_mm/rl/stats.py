"""What an RL step reports: typed, additive counts each DP group fills in, summed across groups
once per step, then turned into the metrics a person plots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import psutil
import torch.distributed as dist

from yatt_mm.metrics import Timeline
from yatt_mm.reward.rewarder import reward_metrics
from yatt_mm.rl.distributed import sum_across
from yatt_mm.simulate.replay import busy_seconds


SOURCE_COUNTS = ("groups", "responses", "reward_sum", "valid")  # RolloutStats.by_source, per blend source
COUNT_DICTS = ("reward_counts", "by_source", "data_counts")  # RolloutStats' dicts, summed key by key


@dataclass
class RolloutStats:
    """Everything one DP group generated and chose this step. Reward statistics cover every
    generated response, before filtering (filtered rewards are biased)."""

    groups: float = 0.0
    responses: float = 0.0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    response_tokens: float = 0.0
    prompt_tokens: float = 0.0  # the generated prompts' tokens, media tokens included (vLLM's count)
    truncated: float = 0.0  # responses cut at the length limit
    turns: float = 0.0  # assistant turns (rollout.engine.tools: more than one a response)
    tool_calls: float = 0.0  # tool replies the responses got
    tool_errors: float = 0.0  # of which errors (a call that could not be read or served)
    overlong_penalty: float = 0.0  # summed DAPO soft penalties (algorithm.overlong.soft_penalty)
    gen_seconds: float = 0.0
    gen_cpu: float = 0.0  # CPU seconds the controller's process used while generating
    valid_generated: float = 0.0
    padded: float = 0.0
    waves: float = 0.0
    from_buffer: float = 0.0
    stale_dropped: float = 0.0  # buffered groups dropped as staler than run.max_staleness
    partial: float = 0.0  # responses that took new weights while generating (run.partial_rollout)
    judge_busy: float = 0.0  # partial colocation: seconds some judge request was open
    judge_busy_generating: float = 0.0  # of which while the rollout engine was still generating
    judged: float = 0.0  # partial colocation: responses streamed to the judges
    split_units: float = 0.0  # the devices split between rollout and judges (partial colocation's deciding ranks)
    split_judge_units: float = 0.0  # of which the judges had this step
    split_next_judge_units: float = 0.0  # of which the judges get next step
    split_moves: float = 0.0  # notches moved toward the judges (negative: away)
    split_backlog: float = 0.0  # responses still waiting for the judges when generation ended
    split_reason: str = ""  # why the split is what it is next step (this rank's decision; not summed)
    reward_counts: dict[str, float] = field(default_factory=dict)  # the rewarder's; same keys on every group
    # data.blend: per source, "<name>/groups", "/responses", "/reward_sum", "/valid" (see for_sources)
    by_source: dict[str, float] = field(default_factory=dict)
    data_counts: dict[str, float] = field(default_factory=dict)  # samples left out so far (ParallelSource.data_counts)

    @classmethod
    def for_sources(cls, names: list[str]) -> "RolloutStats":
        """Empty stats with a blend's per-source counts: the same keys on every DP group."""
        return cls(by_source={f"{n}/{k}": 0.0 for n in names for k in SOURCE_COUNTS})

    def add_wave(self, groups, seconds: float, cpu_seconds: float = 0.0, prompt_tokens: int = 0) -> None:
        self.gen_seconds += seconds
        self.prompt_tokens += prompt_tokens
        self.gen_cpu += cpu_seconds
        for g in groups:
            self.groups += 1
            self.responses += len(g.rewards)
            self.reward_sum += sum(g.rewards)
            self.reward_sq_sum += sum(r * r for r in g.rewards)
            self.response_tokens += sum(r.sampled_tokens for r in g.responses)  # the tools' replies not counted
            self.turns += sum(r.turns for r in g.responses)
            self.tool_calls += sum(r.tool_calls for r in g.responses)
            self.tool_errors += sum(r.tool_errors for r in g.responses)
            self.truncated += sum(r.finish_reason == "length" for r in g.responses)
            self.partial += sum(r.weight_updates > 0 for r in g.responses)
            self.overlong_penalty += sum(g.reward_parts.get("overlong", ()))

    def add_sources(self, groups, is_valid) -> None:
        """A blend's groups counted by their source (before filtering, like the reward's)."""
        for g in groups:
            if not g.prompt.source:
                continue
            counts = {"groups": 1.0, "responses": len(g.rewards), "reward_sum": sum(g.rewards),
                      "valid": float(is_valid(g))}
            for k, v in counts.items():
                self.by_source[f"{g.prompt.source}/{k}"] += v

    def add_overlap(self, judge_spans: list[dict], generation_end: float) -> None:
        """The union of the judge requests' open intervals, and its part before the end of
        generation."""
        intervals = [(s["start"], s["end"]) for s in judge_spans]
        self.judge_busy += busy_seconds(intervals)
        self.judge_busy_generating += busy_seconds(intervals, until=generation_end)
        self.judged += len({(s["prompt"], s.get("sample", 0)) for s in judge_spans})

    def add_split(self, decision) -> None:
        """The device split this step ran with and the one chosen for the next (a Decision of
        yatt_mm/rl/split.py; None where this rank does not decide one)."""
        if decision is None:
            return
        self.split_units += decision.split.units
        self.split_judge_units += decision.split.judge
        self.split_next_judge_units += decision.next.judge
        self.split_moves += decision.move
        self.split_backlog += decision.backlog
        self.split_reason = decision.reason

    def add_choice(self, chosen) -> None:
        """The dynamic sampler's outcome (a StepGroups)."""
        self.valid_generated += chosen.valid_generated
        self.padded += chosen.padded
        self.waves += chosen.waves
        self.from_buffer += chosen.from_buffer

    def summed(self, group) -> "RolloutStats":
        """The sum over every DP group (a collective over `group`, the groups' leaders)."""
        numbers = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in COUNT_DICTS + ("split_reason",)}
        counts = {f"{d}/{k}": v for d in COUNT_DICTS for k, v in getattr(self, d).items()}
        total = sum_across(numbers | counts, group)
        dicts = {d: {k.split("/", 1)[1]: v for k, v in total.items() if k.startswith(f"{d}/")} for d in COUNT_DICTS}
        return RolloutStats(**{k: total[k] for k in numbers}, **dicts, split_reason=self.split_reason)

    def data_metrics(self) -> dict[str, float]:
        """What the data gave: samples left out so far, and a blend's sources side by side (their
        share of this step's groups, their reward and valid-group rate: which dataset is too easy
        or too hard for the policy now)."""
        out = {f"data/{k}": v for k, v in self.data_counts.items()}
        names = dict.fromkeys(k.rsplit("/", 1)[0] for k in self.by_source)
        for n in names:
            groups, responses = self.by_source[f"{n}/groups"], self.by_source[f"{n}/responses"]
            out[f"data/{n}/groups_share"] = groups / max(self.groups, 1.0)
            if groups:
                out[f"data/{n}/reward_mean"] = self.by_source[f"{n}/reward_sum"] / responses
                out[f"data/{n}/valid_group_rate"] = self.by_source[f"{n}/valid"] / groups
        return out

    def metrics(self, rule_names: list[str], judge_names: list[str]) -> dict[str, float]:
        out = {"rollout/groups_generated": self.groups, "rollout/padded_groups": self.padded,
               "rollout/waves": self.waves, "rollout/from_buffer": self.from_buffer}
        if self.judge_busy:  # partial colocation: the share of judging done while generation ran
            out["placement/judge_overlap"] = self.judge_busy_generating / self.judge_busy
            out["placement/judge_seconds_per_response"] = self.judge_busy / max(self.judged, 1)
        if self.split_units:  # the devices' split between rollout and judges, and its decision
            out |= {"placement/judge_share": self.split_judge_units / self.split_units,
                    "placement/next_judge_share": self.split_next_judge_units / self.split_units,
                    "placement/judge_units": self.split_judge_units, "placement/resplit": self.split_moves,
                    "placement/judge_backlog": self.split_backlog, "placement/reason": self.split_reason}
        out.update(reward_metrics(self.reward_counts, rule_names, judge_names))
        out.update(self.data_metrics())
        if not self.responses:  # the whole step came from dynamic sampling's buffer
            return out
        n = self.responses
        mean = self.reward_sum / n
        if self.turns > n:  # multi-turn responses (tools)
            out |= {"rollout/turns_mean": self.turns / n, "rollout/tool_calls_mean": self.tool_calls / n,
                    "rollout/tool_error_rate": self.tool_errors / max(self.tool_calls, 1)}
        return {
            **out,
            "rollout/reward_mean": mean,
            "rollout/reward_std": math.sqrt(max(self.reward_sq_sum / n - mean * mean, 0.0)),
            "rollout/valid_group_rate": self.valid_generated / max(self.groups, 1),
            "rollout/response_length": self.response_tokens / n,
            # prompt + media tokens a prompt: what a long video costs (data.max_sample_tokens bounds it)
            "rollout/prompt_length": self.prompt_tokens / max(self.groups, 1),
            "rollout/truncated_rate": self.truncated / n,
            "rollout/overlong_penalty": self.overlong_penalty / n,
            "rollout/tokens_per_s": self.response_tokens / max(self.gen_seconds, 1e-9),
            # the cores' worth of CPU generation got (about 1 for one busy thread; less: other processes took it)
            "placement/rollout_cpu_share": self.gen_cpu / max(self.gen_seconds, 1e-9),
        }


# wait_rollout: a step's wait for the rollout generated ahead, before its weight sync (run.max_staleness)
TIMED_PHASES = ("rollout", "reward", "teacher", "rollout_reward", "prepare", "balance", "logprobs", "train", "wait_rollout", "sync",
                "probe", "eval")


def time_metrics(timeline: Timeline, step: int, seconds: float, group) -> dict[str, float]:
    """Each phase's seconds, the step's idle share and memory: the slowest rank's (a collective)."""
    phases = timeline.seconds(step)
    busy = sum(v for k, v in phases.items() if not k.startswith("switch:"))
    # the same keys on every rank: a rank may skip a phase (all groups from the buffer, no eval)
    local = {f"time/{k}": phases.get(k, 0.0) for k in TIMED_PHASES}
    local["time/step"] = seconds
    local["time/idle"] = max(seconds - busy, 0.0)
    local["memory/rss_gb"] = psutil.Process().memory_info().rss / 2**30
    peak = sum_across(local, group, op=dist.ReduceOp.MAX)
    return {**peak, "time/idle_share": peak["time/idle"] / max(peak["time/step"], 1e-9)}


def progress_line(step: int, steps: int, m: dict[str, float]) -> str:
    if "rollout/reward_mean" in m:
        parts = [f"step {step + 1}/{steps}", f"reward {m['rollout/reward_mean']:.3f}",
                 f"valid {m['rollout/valid_group_rate']:.2f}"]
    else:
        parts = [f"step {step + 1}/{steps}", f"all {m['rollout/from_buffer']:.0f} groups from the buffer"]
    if "eval/reward_mean" in m:
        parts.append(f"eval {m['eval/reward_mean']:.3f}")
    parts += [f"{k.split('/')[1]} agrees with {k.split('/agreement_', 1)[1]} {v:.2f}" for k, v in m.items()
              if k.startswith("genrm/") and "/agreement_" in k]
    times = " ".join(f"{k[5:]} {v:.1f}" for k, v in m.items()
                     if k.startswith("time/") and k not in ("time/step", "time/idle_share", "time/idle") and v >= 0.05)
    parts += [f"{m['time/step']:.1f}s ({times})", f"lp-diff {m.get('train/logprob_diff_vs_rollout', 0):.1e}"]
    return " | ".join(parts)


def summed_metrics(run, rollout: RolloutStats) -> tuple[RolloutStats, dict[str, float]]:
    """A step's rollout statistics summed over every DP group (a collective over the leaders),
    and their metrics."""
    summed = rollout.summed(run.ranks.leaders_cpu)
    return summed, summed.metrics(run.rule_names, run.judges.names)
