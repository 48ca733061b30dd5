"""Starting torch.distributed and Megatron's model-parallel groups: the one place that does it.

Under torchrun the process group comes from its environment (NCCL on a GPU, gloo otherwise);
a plain `python` process gets a one-rank gloo group on a free local port, so single-process
tools (parity, doctor, tests, benchmarks) run the same code as the ranks of a job.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """torch.distributed from torchrun's environment, or one local gloo rank; idempotent."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def init_parallel(tensor_parallel: int = 1, seed: int = 1234) -> None:
    """torch.distributed, then Megatron's tensor/data-parallel groups and its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp_mod

    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() % tensor_parallel:
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of "
                             f"trainer.tensor_parallel={tensor_parallel}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
        tp_mod.model_parallel_cuda_manual_seed(seed)
