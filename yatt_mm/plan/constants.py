"""The figures the plan assumes besides the architecture and the config: the one calibrated
constant, the CUDA overheads measured on a GPU, the vLLM estimates no GPU has measured yet, and
fixed settings of the engines."""

from __future__ import annotations


GIB = 2**30

# Scales the activation count. benchmarks/bench_memory_plan.py fits it (median measured/planned
# peak over its activation-bound configs, on CPU): 0.99, with every config within 4%. The count
# is tensor by tensor, so the fit leaves nothing to correct beyond that spread: kept at 1.0.
ACTIVATION_CALIBRATION = 1.0
# Measured by scripts/gpu_check.sh's memory stage on one NVIDIA H200 (torch 2.11.0+cu130, NCCL
# 2.28.9, driver 580.159; docs/gpu-and-multinode.md#measured-on-an-h200), on one NCCL rank after
# three GRPO steps of a Qwen2-VL at the 2B model's widths:
# each process that uses a GPU: device memory outside torch's caching allocator (CUDA context
# 0.51 GiB, NCCL 0.63, then cuBLAS/cuDNN workspaces and kernels loaded on first use); the same at
# 2 and 28 layers. NCCL's buffers grow with the peers a rank talks to: more ranks hold more (not
# measured, one GPU).
CUDA_CONTEXT_GIB = 2.44
# the caching allocator's reserve over its peak allocation in the update, as a share of the
# trainer's peak: 0.06 at the 2B model's 28 layers (0.17 at 2 layers, where the 151,936-wide
# logits are most of every allocation)
ALLOCATOR_SLACK = 0.06
MEASURED_ON = "one NVIDIA H200 (torch 2.11, CUDA 13.0) by scripts/gpu_check.sh"
# Estimates (vLLM is not on the GPU machine these were measured on):
VLLM_RESERVE_GIB = 2.5  # inside an engine's share, besides weights and KV cache: profiled forward peak, CUDA graphs
VLLM_ASLEEP_GIB = 0.5  # what a sleeping vLLM engine keeps on its GPU (graph pool, allocator blocks)
PROMPT_TEXT_TOKENS = 128  # text of a prompt besides its media (question, chat template)
VLLM_DTYPE_BYTES = 2  # vLLM runs bf16 on GPUs (engines/engine.py)
JUDGE_SERVER_MAX_MODEL_LEN = 2048  # engines/server.py starts judge servers with this


class PlanError(ValueError):
    """An input the plan cannot work with: an unknown model, a layout the model does not split
    into, an impossible cluster figure or assumption. `yatt-mm plan` prints it and exits 2."""
