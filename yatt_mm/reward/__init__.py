"""Rewards: rule functions chosen by name, and GenRM judges on vLLM; combined by weights."""
