"""Expert load of a Megatron mixture-of-experts model over a training step, for the metrics log.

A forward hook on every router (Megatron's TopKRouter, `mlp.router` of each MoE layer) adds up
its routing map (which experts each token went to) while the model trains; the routers of the
frozen reference and of the no-gradient logprob passes are not counted (eval mode or no grad:
under full activation recompute the router runs twice, once without grad, so each micro-batch
counts once, as Megatron's own aux loss does). Padding does not count when the model hands its
routers a padding mask (models/qwen3vl_moe/model.py does for right-padded rows), as Megatron's
load-balancing loss then leaves it out; otherwise every token the experts compute counts.

`metrics()` sums the counts over the data-parallel ranks (each rank routes its own tokens to all
experts, under expert parallelism too; TP peers route the same tokens and are not added) and the
pipeline stages (each holds its layers), then per layer: the busiest expert's tokens over the
mean per expert (1 = perfectly balanced, at most experts / top-k), and the idlest expert's (0 =
an expert got nothing). The load-balancing loss is Megatron's, from its aux-loss tracker
(megatron/core/transformer/moe/moe_utils.py), unscaled by the coefficient (1 = balanced):
averaged over the micro-batches of every DP rank, then over layers. Keys (`moe/...`):

    load_max_over_mean        mean over layers of max/mean tokens per expert
    load_max_over_mean_worst  the largest over layers; load_worst_layer: which (from 0)
    load_min_over_mean_worst  the smallest over layers of min/mean tokens per expert
    aux_loss                  the load-balancing loss (only when the model's coefficient is > 0)

A dense model has no routers: `ExpertLoad.of` gives None and no key is logged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertLoad:
    def __init__(self, module: torch.nn.Module, routers: list):
        self.experts = int(module.config.num_moe_experts)
        self.layers = int(module.config.num_layers)  # the whole model's (routers number layers globally)
        self.numbers = [int(r.layer_number) for r in routers]  # 1-based, as Megatron's
        self.counts = torch.zeros(len(routers), self.experts, dtype=torch.float64)
        self.calls = torch.zeros(len(routers), dtype=torch.float64)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    @classmethod
    def of(cls, module: torch.nn.Module | None) -> "ExpertLoad | None":
        """Hooks on the routers of `module` (the family's model, inside DDP or not); None when it
        has none (a dense model) or there is no module."""
        module = getattr(module, "module", module)
        routers = routers_of(module)
        return cls(module, routers) if routers else None

    def _hook(self, i: int):
        def hook(router, args, output):
            if router.training and torch.is_grad_enabled():
                _, routing_map = output  # [tokens, experts] bool
                routing_map = real_tokens(routing_map, args)
                self.counts[i] += routing_map.detach().sum(0).to("cpu", torch.float64)
                self.calls[i] += 1
        return hook

    def reset(self) -> None:
        """Start a step: counts and Megatron's aux-loss tracker at zero."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.calls.zero_()
        clear_aux_losses_tracker()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def metrics(self, dp_group=None, pp_group=None, cp_group=None) -> dict[str, float]:
        """The step's load metrics (see the module's docstring); a collective over `dp_group`,
        `pp_group` and `cp_group` (CPU groups; None: this rank alone). The CP ranks route their
        own chunks of the same micro-batches: their counts and load-balancing losses (each a
        share of the micro-batch's, Megatron counting tokens over the CP group) add up, their
        micro-batches are the same ones."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        index = [n - 1 for n in self.numbers]
        counts = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        counts[index] = self.counts
        aux = torch.zeros(self.layers, 2, dtype=torch.float64)  # per layer: sum over micro-batches, micro-batches
        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracked is not None:
            aux[index, 0] = tracked["values"].detach().to("cpu", torch.float64)[index]
            aux[index, 1] = self.calls
        if dist.is_initialized():
            for group in (dp_group, pp_group):
                if group is not None:
                    dist.all_reduce(counts, group=group)
                    dist.all_reduce(aux, group=group)
            if cp_group is not None:
                dist.all_reduce(counts, group=cp_group)
                losses = aux[:, 0].contiguous()
                dist.all_reduce(losses, group=cp_group)
                aux[:, 0] = losses
        moe = counts.sum(1) > 0  # layers that routed tokens this step
        if not bool(moe.any()):
            return {}
        counts = counts[moe]
        mean = counts.sum(1) / self.experts
        high, low = counts.max(1).values / mean, counts.min(1).values / mean
        worst = int(high.argmax())
        out = {"moe/load_max_over_mean": float(high.mean()), "moe/load_max_over_mean_worst": float(high[worst]),
               "moe/load_worst_layer": float(torch.nonzero(moe).flatten()[worst]),
               "moe/load_min_over_mean_worst": float(low.min())}
        if tracked is not None and bool((aux[:, 1] > 0).any()):
            per_layer = aux[moe, 0] / aux[moe, 1].clamp(min=1)  # the mean over every DP rank's micro-batches
            out["moe/aux_loss"] = float(per_layer.mean())
        return out


def routers_of(module: torch.nn.Module | None) -> list:
    """The TopKRouters of `module` (inside DDP or not), in layer order; [] for a dense model or none."""
    if module is None:
        return []
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in getattr(module, "module", module).modules() if isinstance(m, TopKRouter)]


def real_tokens(per_token: torch.Tensor, router_args: tuple) -> torch.Tensor:
    """`per_token` ([tokens, ...], a router call's rows) without the padding rows, from the padding
    mask [s, b] (True = padding) the model hands every router as its second argument."""
    if len(router_args) > 1 and router_args[1] is not None:
        return per_token[~router_args[1].reshape(-1).to(per_token.device)]
    return per_token
