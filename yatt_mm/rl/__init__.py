"""The RL loop: per-DP-group controllers, GRPO with dynamic sampling, placements."""
