"""`yatt-mm plan`: how much GPU and host memory an RL config needs, per phase and per GPU,
before any GPU is spent on finding out.

The numbers come from the architecture (the policy's config.json, or a built-in table of the
published Qwen2-VL / Qwen2.5-VL configs) and the config's settings:

- trainer weights, the DDP gradient buffer (fp32: `grad_reduce_in_fp32=True`, models/trainer.py)
  and Adam's state (m and v in fp32, plus fp32 master weights for bf16; divided by DP with the
  distributed optimizer, which shards it over the DP group; a MoE's experts, split over the
  expert-parallel ranks, over the expert-data-parallel group), all per tensor-parallel rank,
  counted parameter by parameter as models/qwen2vl/model.py + vision.py lay them out;
- activations, counted tensor by tensor in the form of Korthikanti et al.'s per-layer formula
  for Megatron ("Reducing Activation Recomputation in Large Transformer Models", 2022:
  s*b*h*(34 + 5*a*s/h) bytes a layer), with the terms of this model (GQA, SwiGLU, M-RoPE, fp32
  softmax, no dropout, a MoE's dispatched token copies and experts) and the recompute setting,
  for the fullest context-parallel rank's share of the rows; one constant,
  `ACTIVATION_CALIBRATION`, is measured on real train steps by benchmarks/bench_memory_plan.py;
- vLLM engines: their share of the GPU (`gpu_memory_utilization`), split into weights, KV cache
  and a reserve; judge servers, which stay resident on their GPU in every phase;
- which role holds what in each phase, from the placement plan (yatt_mm/rl/placement.py): with
  offload, the trainer waits in host memory during rollout and vLLM sleeps during training.

Calibrated on CPU, then checked on one H200 (scripts/gpu_check.sh at the 2B model's widths and
depth: resident state equal, phase peaks within 1.3% and 4.3%); the CUDA context and the
allocator's slack were measured there (`MEASURED_ON`); vLLM's reserve and asleep figures are
estimates, not measurements.

The package, one job a module (each imports only those above it in this list):
  constants      GIB, the calibration constant, the estimates, PlanError
  cluster        the inputs besides the config (Cluster: the config's cluster section, flags over it;
                 Assumptions) and their checks
  architectures  a model setting -> its architecture (config.json, tiny models, the built-in table)
  params         parameter counts per TP rank, pipeline stage and expert-parallel rank; active parameters
  batch          the largest training micro-batch, and a context-parallel rank's share of it
  flops          a micro-batch's training FLOPs per GPU (from the active parameters)
  activations    activation memory per micro-batch (Kernels: what CUDA and CPU keep differently)
  trainer        one trainer rank: weights, gradients, optimizer state, activations
  engines        vLLM engines: weights, KV cache, reserve
  phases         memory per phase and GPU, and host memory for offload
  planner        make_plan: all of it for one config on one cluster, as a Plan
  advice         which settings make a plan that does not fit fit
  report         the plan as text
  command        `yatt-mm plan` (run_plan): checks, plan, report, advice, exit code
"""

from __future__ import annotations

from yatt_mm.plan.activations import (CPU, CUDA, Activations, Block, Kernels, activation_bytes, dispatched_bytes,
                                      language_block, layer_bytes, vision_block)
from yatt_mm.plan.advice import advise, candidate_changes, over_limit
from yatt_mm.plan.architectures import KNOWN_MODELS, known_hf_config, load_spec, resolve_model, spec_from_hf_config
from yatt_mm.plan.batch import MicroBatchShape, context_share, media_per_sample, rl_micro_batch
from yatt_mm.plan.cluster import Assumptions, Cluster, check_inputs, cluster_sources, input_problems, plan_cluster
from yatt_mm.plan.command import run_plan
from yatt_mm.plan.constants import (ACTIVATION_CALIBRATION, ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, GIB,
                                    JUDGE_SERVER_MAX_MODEL_LEN, MEASURED_ON, PROMPT_TEXT_TOKENS, VLLM_ASLEEP_GIB,
                                    VLLM_DTYPE_BYTES, VLLM_RESERVE_GIB, PlanError)
from yatt_mm.plan.engines import EngineMemory, engine_memory, kv_bytes_per_token, state_bytes_per_sequence
from yatt_mm.plan.flops import train_flops
from yatt_mm.plan.params import Params, active_params, param_counts
from yatt_mm.plan.phases import GpuPhase, Line, gpu_phases, host_lines
from yatt_mm.plan.planner import Plan, make_plan
from yatt_mm.plan.report import format_plan
from yatt_mm.plan.trainer import TrainerMemory, stage_memory, trainer_memory

__all__ = [
    "ACTIVATION_CALIBRATION", "ALLOCATOR_SLACK", "CPU", "CUDA", "CUDA_CONTEXT_GIB", "GIB", "JUDGE_SERVER_MAX_MODEL_LEN",
    "KNOWN_MODELS", "MEASURED_ON", "PROMPT_TEXT_TOKENS", "VLLM_ASLEEP_GIB", "VLLM_DTYPE_BYTES", "VLLM_RESERVE_GIB",
    "Activations", "Assumptions", "Block", "Cluster", "EngineMemory", "GpuPhase", "Kernels", "Line", "MicroBatchShape",
    "Params", "Plan", "PlanError", "TrainerMemory",
    "active_params", "activation_bytes", "advise", "candidate_changes", "check_inputs", "cluster_sources",
    "context_share",
    "dispatched_bytes", "engine_memory", "format_plan", "gpu_phases",
    "host_lines", "input_problems", "known_hf_config", "kv_bytes_per_token", "language_block", "layer_bytes",
    "load_spec", "make_plan", "media_per_sample", "over_limit", "param_counts", "plan_cluster", "resolve_model",
    "rl_micro_batch",
    "run_plan", "spec_from_hf_config", "stage_memory", "state_bytes_per_sequence", "train_flops", "trainer_memory",
    "vision_block",
]
