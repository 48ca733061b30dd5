"""vLLM engines (rollout, in-process judges, judge servers): their share of the GPU, split into
weights, KV cache (with a hybrid model's per-sequence recurrent state) and a reserve."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.constants import GIB, VLLM_DTYPE_BYTES, VLLM_RESERVE_GIB
from yatt_mm.plan.params import linear_layers, param_counts



def kv_bytes_per_token(spec, tp: int) -> int:
    """K and V of every softmax-attention layer in bf16 (a hybrid model's linear-attention layers
    keep none: `state_bytes_per_sequence`); KV heads split over TP (replicated when fewer than TP)."""
    full = linear_layers(spec).count(False)
    return 2 * full * max(1, spec.num_kv_heads // tp) * spec.head_dim * VLLM_DTYPE_BYTES


def state_bytes_per_sequence(spec, tp: int) -> int:
    """What each running sequence holds in a hybrid model's linear-attention (gated DeltaNet)
    layers, whatever its length, in vLLM's layout (mamba_utils.gated_delta_net_state_shape, bf16
    by default): the recurrent state, value heads x value dim x key dim, and the conv state, the
    last kernel - 1 inputs of the conv's q, k, v channels; both split over TP. 0 without such
    layers. vLLM pads these pages to its attention page size: an estimate, a lower bound."""
    n = linear_layers(spec).count(True)
    if not n:
        return 0
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    conv_channels = 2 * spec.linear_num_key_heads * dk + nv * dv
    return n * (nv // tp * dv * dk + conv_channels // tp * (spec.linear_conv_kernel_dim - 1)) * VLLM_DTYPE_BYTES


@dataclass(frozen=True)
class EngineMemory:
    name: str
    share: float  # gpu_memory_utilization
    total: int  # share x GPU memory: what vLLM takes when it starts
    weights: int
    kv_cache: int
    kv_tokens: int  # tokens of max_model_len sequences the cache holds (with their recurrent state)
    max_model_len: int
    state_bytes: int = 0  # per sequence: a hybrid model's recurrent state (`state_bytes_per_sequence`)

    @property
    def starts(self) -> bool:
        """vLLM refuses to start when its KV cache cannot hold one sequence of max_model_len."""
        return self.kv_tokens >= self.max_model_len


def engine_memory(name: str, spec, share: float, gpu_bytes: int, tp: int, max_model_len: int) -> EngineMemory:
    total = int(share * gpu_bytes)
    weights = param_counts(spec).total * VLLM_DTYPE_BYTES // tp
    kv = max(0, total - weights - int(VLLM_RESERVE_GIB * GIB))
    state, per_token = state_bytes_per_sequence(spec, tp), kv_bytes_per_token(spec, tp)
    if state:  # each sequence also holds its state: count whole sequences of max_model_len
        tokens = kv // (max_model_len * per_token + state) * max_model_len
    else:
        tokens = kv // per_token
    return EngineMemory(name, share, total, weights, kv, tokens, max_model_len, state)
