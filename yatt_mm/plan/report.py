"""The plan as text: the model and cluster, the trainer and engines, a table of GPU memory per
phase, host memory, notes."""

from __future__ import annotations

from yatt_mm.plan.architectures import resolve_model
from yatt_mm.plan.constants import GIB
from yatt_mm.plan.params import param_counts
from yatt_mm.plan.phases import GpuPhase
from yatt_mm.plan.planner import Plan


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_plan(plan: Plan) -> str:
    cfg, c, t, s, spec = plan.cfg, plan.cluster, plan.trainer, plan.shape, plan.spec
    tcfg, full = cfg.policy.trainer, param_counts(plan.spec)
    out = [f"model {cfg.policy.model} ({resolve_model(cfg.policy.model)[1]}): {full.total / 1e9:.2f} B parameters "
           f"(vision {full.vision / 1e9:.2f} B, language {full.language / 1e9:.2f} B)",
           f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB; placement "
           f"{cfg.run.placement}; trainer TP {tcfg.tensor_parallel} x PP {tcfg.pipeline_parallel} x DP {plan.dp}, "
           f"{tcfg.dtype}, distributed optimizer {'on' if tcfg.distributed_optimizer else 'off'}, recompute "
           f"{tcfg.recompute}, {t.params.total / 1e9:.2f} B parameters per GPU"
           + (f" (pipeline stage {t.stage} of {tcfg.pipeline_parallel}, the fullest: it sets the trainer's lines)"
              if tcfg.pipeline_parallel > 1 else ""),
           f"largest micro-batch (assumed): {s.rows} row(s) x {s.seq} tokens, {s.scored} scored, {s.media_tokens} "
           f"media tokens = {s.media_tokens * spec.spatial_merge_size**2} vision patches in frames of "
           f"{s.frame_tokens} tokens (--seq-len, --media-tokens, --frame-tokens)",
           f"trainer per GPU (GiB): weights {gib(t.weights)}, gradients {gib(t.grads)}, optimizer "
           f"{gib(t.optimizer)}, activations {gib(t.activations.peak)} at the peak ({gib(t.activations.saved)} saved)"]
    for e in [plan.rollout, *plan.judges.values()]:
        out.append(f"{e.name} (vLLM): share {e.share:g} = {gib(e.total)} GiB: weights {gib(e.weights)}, KV cache "
                   f"{gib(e.kv_cache)} GiB = {e.kv_tokens} tokens = {e.kv_tokens // max(e.max_model_len, 1)} "
                   f"sequences of {e.max_model_len}")
    for gpus in dict.fromkeys(p.gpus for p in plan.phases):
        out += ["", f"GPU memory per phase (GiB): {gpus}"]
        out += _gpu_table([p for p in plan.phases if p.gpus == gpus])
    out += ["", f"host memory per node, pinned for offload (GiB): {gib(plan.host_total)}"
            + (f" of {c.host_memory_gib:g}" if c.host_memory_gib else "")]
    out += [f"  {line.what:<{LABEL}}{gib(line.nbytes):>{COLUMN}}" for line in plan.host]
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


LABEL, COLUMN = 44, 9
# the rows of a GPU table: the trainer's lines first, then the engines'
_ROW_ORDER = ("trainer weights", "gradients", "optimizer", "activations", "forward-only", "reference",
              "weight export", "allocator", "vLLM rollout", "judge ", "CUDA")


def _row_rank(name: str) -> int:
    return next((i for i, prefix in enumerate(_ROW_ORDER) if name.startswith(prefix)), len(_ROW_ORDER))


def _gpu_table(phases: list[GpuPhase]) -> list[str]:
    """Memory lines down, phases across."""
    names = sorted(dict.fromkeys(line.what for p in phases for line in p.lines), key=_row_rank)
    widths = [max(COLUMN, len(p.phase) + 1) for p in phases]

    def row(label: str, cells: list[str]) -> str:
        return f"  {label:<{LABEL}}" + "".join(c.rjust(w) for c, w in zip(cells, widths))

    rows = [row("", [p.phase for p in phases])]
    for name in names:
        values = [next((ln.nbytes for ln in p.lines if ln.what == name), None) for p in phases]
        rows.append(row(name, ["-" if v is None else gib(v) for v in values]))
    rows.append(row("total", [gib(p.total) for p in phases]))
    rows.append(row(f"of {phases[0].limit / GIB:g}", ["fits" if p.fits else "OVER" for p in phases]))
    return rows
