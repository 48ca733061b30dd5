"""The simulated timelines as a PNG: per placement, when each role held devices and worked."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"rollout": "#4c72b0", "judges": "#dd8452", "switch": "#999999"}


def draw_timelines(rows: list[tuple[str, dict[str, list[tuple[float, float]]]]], path: str | Path,
                   title: str) -> Path:
    """`rows`: (placement label, {role: busy intervals}) for one step each; "switch" intervals
    are drawn on both roles' lanes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.7 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, (label, lanes) in zip(axes[:, 0], rows):
        for y, role in enumerate(("judges", "rollout")):
            for a, b in lanes.get(role, []):
                ax.broken_barh([(a, b - a)], (y - 0.35, 0.7), color=COLOURS[role])
            for a, b in lanes.get("switch", []):
                ax.broken_barh([(a, b - a)], (y - 0.35, 0.7), color=COLOURS["switch"], hatch="//")
        end = max((b for spans in lanes.values() for _, b in spans), default=0.0)
        ax.set_yticks([0, 1], ["judges", "rollout"])
        ax.set_title(f"{label}: {end:.2f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of rollout")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
