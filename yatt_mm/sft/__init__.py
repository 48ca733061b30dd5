"""Supervised fine-tuning: config, examples, collate, held-out evaluation, and the train loop."""
