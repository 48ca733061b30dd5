"""The trainer's model: Megatron-Core Qwen2-VL, HF conversion, logprobs, tiny offline models.

Importing this package installs the import hooks that apply the CPU runtime fixes
(`models/runtime.py`); it imports nothing heavy itself.
"""

from models import _hooks  # noqa: F401
