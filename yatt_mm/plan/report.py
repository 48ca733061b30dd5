"""The plan as text: the model and cluster, the trainer and engines, a table of GPU memory per
phase, host memory, notes."""

from __future__ import annotations

from yatt_mm.plan.architectures import resolve_model
from yatt_mm.plan.constants import GIB
from yatt_mm.plan.flops import train_flops
from yatt_mm.plan.params import active_params, param_counts
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
           f"{cfg.run.placement}; trainer TP {tcfg.tensor_parallel}"
           + (f" x CP {tcfg.context_parallel}" if tcfg.context_parallel > 1 else "")
           + f" x PP {tcfg.pipeline_parallel} x DP {plan.dp}"
           + (f", EP {tcfg.expert_parallel}" if tcfg.expert_parallel > 1 else "") + ", "
           f"{tcfg.dtype}, distributed optimizer {'on' if tcfg.distributed_optimizer else 'off'}, recompute "
           f"{tcfg.recompute}, {t.params.total / 1e9:.2f} B parameters per GPU"
           + (f" (pipeline stage {t.stage} of {tcfg.pipeline_parallel}, the fullest: it sets the trainer's lines)"
              if tcfg.pipeline_parallel > 1 else ""),
           f"largest micro-batch (assumed): {s.rows} row(s) x {s.seq} tokens, {s.scored} scored, {s.media_tokens} "
           f"media tokens = {s.media_tokens * spec.spatial_merge_size**2} vision patches in frames of "
           f"{s.frame_tokens} tokens (--seq-len, --media-tokens, --frame-tokens)",
           f"trainer per GPU (GiB): weights {gib(t.weights)}, gradients {gib(t.grads)}, optimizer "
           f"{gib(t.optimizer)}, activations {gib(t.activations.peak)} at the peak ({gib(t.activations.saved)} saved)"]
    if t.adapter:
        targets = ", ".join(cfg.policy.lora.target_modules) + (
            ", the vision tower's blocks and mergers" if cfg.policy.lora.vision_tower else "")
        out.append(f"LoRA rank {cfg.policy.lora.rank} ({targets}): "
                   f"{t.adapter / 1e6:.1f} M adapter parameters per GPU beside the frozen base, the only ones with "
                   f"gradients and optimizer state; the KL's reference is the base (no second copy); weight sync: "
                   + ("the adapter alone" if cfg.sync.lora == "adapter" else "the merged weights"))
    elif cfg.policy.freeze_vision:
        out.append(f"vision tower frozen: {t.params.vision / 1e9:.2f} B parameters per GPU without gradients or "
                   "optimizer state")
    out += _parallel_lines(plan)
    for e in [plan.rollout, *plan.judges.values()]:
        state = (f" (each with {e.state_bytes / 2**20:.1f} MiB of linear-attention state besides its KV of the "
                 f"full-attention layers)" if e.state_bytes else "")
        out.append(f"{e.name} (vLLM): share {e.share:g} = {gib(e.total)} GiB: weights {gib(e.weights)}, KV cache "
                   f"{gib(e.kv_cache)} GiB = {e.kv_tokens} tokens = {e.kv_tokens // max(e.max_model_len, 1)} "
                   f"sequences of {e.max_model_len}{state}")
    for gpus in dict.fromkeys(p.gpus for p in plan.phases):
        out += ["", f"GPU memory per phase (GiB): {gpus}"]
        out += _gpu_table([p for p in plan.phases if p.gpus == gpus])
    out += ["", f"host memory per node, pinned for offload (GiB): {gib(plan.host_total)}"
            + (f" of {c.host_memory_gib:g}" if c.host_memory_gib else "")]
    out += [f"  {line.what:<{LABEL}}{gib(line.nbytes):>{COLUMN}}" for line in plan.host]
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def _parallel_lines(plan: Plan) -> list[str]:
    """What experts and context parallelism add: the experts per EP rank, the dispatcher's
    buffers, the active parameters and the FLOPs they set; the CP split."""
    cfg, t, spec, s = plan.cfg, plan.trainer, plan.spec, plan.shape
    tcfg, out = cfg.policy.trainer, []
    experts = getattr(spec, "num_experts", 0)
    if experts:
        ep, full = tcfg.expert_parallel, param_counts(spec)
        where = (f"{experts // ep} on each of EP {ep} ranks" if ep > 1 else
                 f"all on every rank, each split over TP {tcfg.tensor_parallel}")
        out.append(f"experts: {experts} a layer, top-{spec.num_experts_per_tok}, {where}: "
                   f"{t.params.experts / 1e9:.2f} B expert + {t.params.dense / 1e9:.2f} B dense parameters per "
                   f"GPU; with the distributed optimizer, Adam's state of the experts sharded over "
                   f"{max(1, plan.dp * tcfg.context_parallel // ep)} ranks (expert data parallel), the rest over "
                   f"{plan.dp * tcfg.context_parallel}")
        out.append(f"token dispatcher: {gib(t.activations.dispatched)} GiB of token copies kept "
                   f"(tokens x top-k x hidden, every layer), {gib(t.activations.dispatch_in_flight)} GiB in flight "
                   f"while a layer dispatches; balanced routing assumed")
        out.append(f"active parameters {active_params(spec) / 1e9:.2f} B of {full.total / 1e9:.2f} B a token")
    if tcfg.context_parallel > 1:
        attention = ("attention by all-to-all over heads, its K/V split too, no masks"
                     if tcfg.context_parallel_comm == "a2a" else "the gathered K/V and the attention masks whole")
        out.append(f"context parallel {tcfg.context_parallel}: each row's {s.seq} tokens split into "
                   f"{2 * tcfg.context_parallel} zig-zag chunks; per rank the language layers' activations are "
                   f"1/{tcfg.context_parallel}, {attention}; the vision tower runs its share of the frames")
    flops = train_flops(spec, s, tcfg.tensor_parallel, tcfg.context_parallel)
    out.append(f"training FLOPs of the largest micro-batch: {flops / 1e12:.1f} TFLOP per GPU (6 x active parameters "
               f"x tokens + attention; an estimate)")
    return out


LABEL, COLUMN = 44, 9
# the rows of a GPU table: the trainer's lines first, then the engines'
_ROW_ORDER = ("trainer weights", "gradients", "optimizer", "activations", "forward-only", "reference",
              "weight export", "allocator", "vLLM rollout", "judge ", "teacher", "CUDA")


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
