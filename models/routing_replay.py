"""Routing replay for mixture-of-experts RL (`algorithm.routing_replay`): the experts each token
went to in the old-logprob pass, recorded per MoE layer and micro-batch, then forced in the update
passes of the same step. An optimizer step moves the router weights too, so without replay a
token near a routing tie can switch experts between the two passes, and its importance ratio then
measures that flip rather than the policy change (Megatron-LM #4168: Qwen3-30B-A3B GRPO collapses
without it).

Megatron-Core 0.16.1's TopKRouter asks its `router_replay` attribute for the top-k of every
forward (`get_replay_topk(scores, topk, ..., default_compute_topk)` in
moe_utils.topk_routing_with_score_function); with replay it takes the probabilities of the forced
experts from the same scores (for Qwen3's softmax after top-k: the softmax over the forced
experts' logits), so gradients still reach the router. Megatron's own RouterReplay holds one
target per layer (one micro-batch at a time) and registers every instance in a process-wide list
(the reference model's and a test's other models too). `MicroBatchRouterReplay` keeps its
router's micro-batches in order instead: one forward consumes one micro-batch's routes, in the
order the schedule runs them (micro-batch order on every pipeline stage), and a full activation
recompute re-runs a micro-batch's forward in its backward, which takes the routes that forward
was given (first in, first out, as the 1F1B schedule runs the backwards in order).

It also measures the routes the router would have chosen itself against the recorded ones (the
natural top-k on the same scores): `moe/route_mismatch`, the fraction of (token, MoE layer)
routings of the update passes whose top-k set differs from the old-logprob pass's. Under replay
the routes used are the recorded ones by construction, so this counts what replay prevented;
without replay (`none`) it counts the flips that happened. Padding does not count (the model
hands its routers the padding mask, models/qwen3vl_moe/model.py).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

from models.moe_metrics import real_tokens, routers_of


def _in_backward() -> bool:
    """Inside autograd's backward: a full recompute re-running a checkpointed forward."""
    return torch._C._current_graph_task_id() != -1


def _sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: the top-k expert sets of each token differ (order within the k ignored)."""
    return (a.sort(1).values != b.sort(1).values).any(1)


class MicroBatchRouterReplay(RouterReplay):
    """One router's routes. mode: "off" (route freely), "record" (route freely, keep each
    forward's top-k indices), "replay" (take the queued routes) or "compare" (route freely,
    measure against the queued routes)."""

    def __init__(self):
        super().__init__()
        # this model's replay is driven through its own routers (RoutingReplay), not Megatron's
        # process-wide list, which would also hold other models' routers
        RouterReplay.global_router_replay_instances.remove(self)
        self.mode = "off"
        self.recorded: list[torch.Tensor] = []  # record: [tokens, k] per forward, on the host
        self.targets: deque[torch.Tensor] = deque()  # replay / compare: [tokens, k] per forward to come
        self.recompute: deque[torch.Tensor] = deque()  # replay: the routes forwards took, for their recompute
        self.differs: torch.Tensor | None = None  # the last forward: [tokens] natural top-k != target

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        def natural():
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

        if _in_backward():
            return self._forced(scores, self.recompute.popleft()) if self.mode == "replay" else natural()
        self.differs = None
        if self.mode == "record":
            probs, indices = natural()
            # kept on the host, 2 bytes an index: a step's routes (tokens x layers x top-k) would
            # otherwise hold accelerator memory through the update passes
            self.recorded.append(indices.detach().to("cpu", torch.int16 if scores.shape[1] <= 2**15 else torch.int32))
            return probs, indices
        if self.mode == "off":
            return natural()
        if not self.targets:
            raise RuntimeError("routing replay: a forward past the recorded micro-batches (the update passes must "
                               "run the micro-batches of the old-logprob pass, in its order)")
        target = self.targets.popleft().to(scores.device, torch.long)
        if target.shape != (scores.shape[0], topk):
            raise RuntimeError(f"routing replay: recorded routes {tuple(target.shape)} for a forward of "
                               f"{scores.shape[0]} tokens, top-{topk}: not the micro-batch that was recorded")
        probs, indices = natural()
        self.differs = _sets_differ(indices.detach(), target)
        if self.mode == "compare":
            return probs, indices
        self.recompute.append(target)
        return self._forced(scores, target)

    @staticmethod
    def _forced(scores: torch.Tensor, target: torch.Tensor):
        """Megatron's replay: the scores of the forced experts (differentiable), their indices."""
        target = target.to(scores.device, torch.long)
        return scores.gather(1, target), target


class RoutingReplay:
    """Routing replay on every router of a Megatron MoE model (`module`, inside DDP or not).
    `force`: the update passes take the recorded routes (routing_replay: train); otherwise they
    route freely and are only compared with them (routing_replay: none)."""

    def __init__(self, routers: list, force: bool):
        self.force = force
        self.routers = routers
        self.replays = [MicroBatchRouterReplay() for _ in routers]
        for router, replay in zip(routers, self.replays):
            router.router_replay = replay
        self.layers = len(routers)
        self.counts = torch.zeros(2, dtype=torch.float64)  # routings that differ, routings compared
        self._handles = [r.register_forward_hook(self._count(i)) for i, r in enumerate(routers)]

    @classmethod
    def of(cls, module: torch.nn.Module | None, force: bool) -> "RoutingReplay | None":
        """None for a model without routers (dense) or no module."""
        routers = routers_of(module)
        return cls(routers, force) if routers else None

    def _count(self, i: int):
        def hook(router, args, output):
            differs = self.replays[i].differs
            if differs is None or _in_backward():
                return
            differs = real_tokens(differs, args)
            self.counts += torch.tensor([float(differs.sum()), float(differs.numel())], dtype=torch.float64)
        return hook

    def _set(self, mode: str) -> None:
        for replay in self.replays:
            replay.mode = mode

    @contextmanager
    def record(self):
        """The forwards inside record their routes; `recorded()` hands them out afterwards."""
        for replay in self.replays:
            replay.recorded = []
        self._set("record")
        try:
            yield
        finally:
            self._set("off")

    def recorded(self) -> list[torch.Tensor]:
        """Per recorded forward (micro-batch), in order: [MoE layers of this rank, tokens, top-k]."""
        per_router = [r.recorded for r in self.replays]
        for r in self.replays:
            r.recorded = []
        if len({len(p) for p in per_router}) > 1:
            raise RuntimeError(f"routing replay: routers recorded {[len(p) for p in per_router]} forwards")
        return [torch.stack(layers) for layers in zip(*per_router)]

    @contextmanager
    def follow(self, routes: list[torch.Tensor]):
        """The forwards inside, one per entry of `routes` (as `recorded()` gave them) and in its
        order, take those routes (force) or compare their own with them."""
        for i, replay in enumerate(self.replays):
            replay.targets = deque(r[i] for r in routes)
            replay.recompute.clear()
        self._set("replay" if self.force else "compare")
        try:
            yield
            left = {len(r.targets) for r in self.replays}
            if left != {0}:
                raise RuntimeError(f"routing replay: {max(left)} of {len(routes)} recorded micro-batches were not run")
        finally:
            self._set("off")
            for replay in self.replays:
                replay.targets.clear()
                replay.recompute.clear()
                replay.differs = None

    def reset(self) -> None:
        self.counts.zero_()

    def metrics(self, dp_group=None, pp_group=None, cp_group=None) -> dict[str, float]:
        """moe/route_mismatch over this step's compared forwards, every DP rank, pipeline stage
        and CP rank's chunks (a collective over the CPU groups); {} when nothing was compared."""
        counts = self.counts.clone()
        if dist.is_initialized():
            for group in (dp_group, pp_group, cp_group):
                if group is not None:
                    dist.all_reduce(counts, group=group)
        if counts[1] == 0:
            return {}
        return {"moe/route_mismatch": float(counts[0] / counts[1])}
