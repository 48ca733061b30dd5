"""Moving a trainer's device memory to host memory and back, in place.

Between training phases the trainer's weights, gradient buffers and optimizer state would sit on
the GPU beside vLLM's weights and KV cache. `HostOffload` copies each tensor storage to (pinned)
host memory and shrinks the device storage to nothing; `reload` grows it back and copies the
bytes in. Working on storages, not tensors, keeps every view valid (Megatron's parameters and
`main_grad`s are views into contiguous buffers; the optimizer holds references to them), so
nothing has to be re-bound, and bytes come back bit for bit. On a CPU the same code runs and
frees the same storages: that is how the round trip is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: contents not kept (gradient buffers, rewritten every step)


class HostOffload:
    def __init__(self):
        self._held: list[_Held] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def offload(self, keep: list[torch.Tensor], drop: list[torch.Tensor] = ()) -> int:
        """Free the device storage of `keep` (contents saved to host) and `drop` (contents
        discarded). Returns the bytes freed. Each storage is handled once, however many views."""
        if self._held:
            raise RuntimeError("already offloaded")
        seen: set[int] = set()
        pin = torch.cuda.is_available()
        for tensors, save in ((keep, True), (drop, False)):
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0 or not storage.resizable():
                    continue  # (not resizable: a CPU storage some allocators make; it stays where it is)
                seen.add(storage.data_ptr())
                host = None
                if save:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                    host.copy_(_bytes_of(storage), non_blocking=pin)
                self._held.append(_Held(storage, storage.nbytes(), host))
        if pin:
            torch.cuda.synchronize()  # the copies must land before the device memory goes
        for held in self._held:
            held.storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return sum(h.nbytes for h in self._held)

    def reload(self) -> int:
        """Device storages back to their size, saved contents copied in, dropped ones zeroed."""
        for held in self._held:
            held.storage.resize_(held.nbytes)
            data = _bytes_of(held.storage)
            if held.host is None:
                data.zero_()
            else:
                data.copy_(held.host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        nbytes = sum(h.nbytes for h in self._held)
        self._held = []
        return nbytes


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer holds: the parameters it steps (fp32 masters under mixed
    precision, else the model's own) and their state (Adam's moments)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out = []
    for opt in inner:
        torch_opt = opt.optimizer
        out += [p for g in torch_opt.param_groups for p in g["params"]]
        out += [v for state in torch_opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return out
