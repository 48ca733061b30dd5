"""`yatt-mm plot RUN_DIR`: PNGs of a run — reward curves and the phase timeline per rank."""

from __future__ import annotations

import json
from pathlib import Path


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _eval_labels(run: Path) -> dict[str, str]:
    """How each eval set was answered and scored ("": eval.shards' own, or all of them), from the
    run's saved config (if any): "greedy, exact_match", "avg@8 at T=0.6, math_verify"."""
    import yaml

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text())["eval"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return {}

    def label(s: dict) -> str:
        samples, temperature = s.get("samples") or cfg.get("samples", 1), s.get("temperature")
        temperature = cfg.get("temperature", 0.0) if temperature is None else temperature
        how = f"avg@{samples} at T={temperature:g}" if samples > 1 else "greedy"
        return f"{how}, {s.get('reward') or cfg.get('reward', '')}"

    return {"": label({})} | {s["name"]: label(s) for s in cfg.get("sets") or []}


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = _read_jsonl(run / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run}/metrics.jsonl is missing or empty: is {run} a yatt-mm run directory?")
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = _eval_labels(run)
    sets = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/") and k.count("/") == 2})
    curves = [("rollout/reward_mean", "training rollouts: total reward (all groups, unfiltered)", "-"),
              ("eval/reward_mean", "held-out prompts" + (" (all sets)" if sets else
                                                         f": {labels['']}" if labels.get("") else ""), "-")]
    # with eval.sets, each set's own curve
    curves += [(f"eval/{name}/reward_mean", f"held-out {name}{f': {labels[name]}' if labels.get(name) else ''}", ":")
               for name in sets]
    # with several reward parts (rules, judges), each part's mean on the training rollouts
    parts = sorted({k for r in records for k in r if k.startswith("reward/")})
    if len(parts) > 1:
        curves += [(k, f"training rollouts: {k.split('/', 1)[1]}", "--") for k in parts]
    for key, label, style in curves:
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            ax.plot(*zip(*pts), style, marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"reward: {run.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    written.append(run / "reward_curve.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    spans = [s for f in sorted(run.glob("timeline_rank*.jsonl")) for s in _read_jsonl(f)]
    spans = [s for s in spans if not s["phase"].startswith("switch:")]
    if spans:
        t0 = min(s["start"] for s in spans)
        phases = sorted({s["phase"] for s in spans})
        colours = {p: plt.cm.tab10(i % 10) for i, p in enumerate(phases)}
        ranks = sorted({s["rank"] for s in spans})
        fig, ax = plt.subplots(figsize=(11, 2.0 + 0.6 * len(ranks)))
        for s in spans:
            ax.barh(s["rank"], s["end"] - s["start"], left=s["start"] - t0, color=colours[s["phase"]],
                    height=0.6 if s["phase"] not in ("rollout", "reward") else 0.35)
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_xlabel("seconds since start (gaps: waiting for other ranks or untimed work)")
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title("phase timeline")
        fig.tight_layout()
        written.append(run / "phase_timeline.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
