"""Rollout on vLLM: multimodal generation with per-token logprobs."""
