"""The figures the plan assumes besides the architecture and the config: the one calibrated
constant, the estimates no GPU has measured yet, and fixed settings of the engines."""

from __future__ import annotations


GIB = 2**30

# Scales the activation count. benchmarks/bench_memory_plan.py fits it (median measured/planned
# peak over its activation-bound configs, on CPU): 0.99, with every config within 4%. The count
# is tensor by tensor, so the fit leaves nothing to correct beyond that spread: kept at 1.0.
ACTIVATION_CALIBRATION = 1.0
# Estimates (no GPU was available to measure them):
CUDA_CONTEXT_GIB = 0.5  # each process that uses a GPU: CUDA context, cuBLAS workspace, NCCL buffers
ALLOCATOR_SLACK = 0.05  # the caching allocator's fragmentation, as a share of the trainer's peak
VLLM_RESERVE_GIB = 2.5  # inside an engine's share, besides weights and KV cache: profiled forward peak, CUDA graphs
VLLM_ASLEEP_GIB = 0.5  # what a sleeping vLLM engine keeps on its GPU (graph pool, allocator blocks)
PROMPT_TEXT_TOKENS = 128  # text of a prompt besides its media (question, chat template)
VLLM_DTYPE_BYTES = 2  # vLLM runs bf16 on GPUs (engines/engine.py)
JUDGE_SERVER_MAX_MODEL_LEN = 2048  # engines/server.py starts judge servers with this


class PlanError(ValueError):
    """An input the plan cannot work with: an unknown model, a layout the model does not split
    into, an impossible cluster figure or assumption. `yatt-mm plan` prints it and exits 2."""
