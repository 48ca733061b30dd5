"""vLLM engines (rollout, in-process judges, judge servers): their share of the GPU, split into
weights, KV cache and a reserve."""

from __future__ import annotations

from dataclasses import dataclass

from yatt_mm.plan.constants import GIB, VLLM_DTYPE_BYTES, VLLM_RESERVE_GIB
from yatt_mm.plan.params import param_counts



def kv_bytes_per_token(spec, tp: int) -> int:
    """K and V of every layer in bf16; KV heads split over TP (replicated when fewer than TP)."""
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * VLLM_DTYPE_BYTES


@dataclass(frozen=True)
class EngineMemory:
    name: str
    share: float  # gpu_memory_utilization
    total: int  # share x GPU memory: what vLLM takes when it starts
    weights: int
    kv_cache: int
    kv_tokens: int
    max_model_len: int

    @property
    def starts(self) -> bool:
        """vLLM refuses to start when its KV cache cannot hold one sequence of max_model_len."""
        return self.kv_tokens >= self.max_model_len


def engine_memory(name: str, spec, share: float, gpu_bytes: int, tp: int, max_model_len: int) -> EngineMemory:
    total = int(share * gpu_bytes)
    weights = param_counts(spec).total * VLLM_DTYPE_BYTES // tp
    kv = max(0, total - weights - int(VLLM_RESERVE_GIB * GIB))
    return EngineMemory(name, share, total, weights, kv, kv // kv_bytes_per_token(spec, tp), max_model_len)
