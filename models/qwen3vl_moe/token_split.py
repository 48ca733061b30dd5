"""Megatron's MoE layer under tensor parallelism without sequence parallelism.

megatron-core 0.16.1's MoE layer expects sequence parallelism beside TP (its forward refuses to
train without it): its token dispatcher all-gathers the tokens of the TP ranks before the
experts (which are split over TP like a dense MLP) and reduce-scatters their outputs back. yatt-mm
runs TP without sequence parallelism: every TP rank holds all the tokens, so that all-gather
would hand every expert each token TP times, and the expert weights' gradients would come out TP
times too large (the forward is right: the reduce-scatter returns each rank its own copy's sum).

`split_tokens_over_tp(layer)` gives the dispatcher what it expects, inside the layer only: the
router runs on all the tokens (as every TP rank did: same routes, same load-balancing loss, same padding
mask and expert-load counts), then each TP rank hands its 1/TP of the tokens, their
probabilities and routes to the dispatcher, and the outputs are all-gathered back. The split's
backward all-gathers the gradients and the gather's backward splits them, so each token's
gradient reaches the experts once and every TP rank gets the whole input gradient, as a dense
TP MLP gives it. A shared expert is not split: it runs on all the tokens as a dense TP MLP and
its output is added after the gather. The token count is padded to a multiple of TP with tokens
routed to no expert. The router's losses count tokens over the context-parallel ranks, not TP.
At TP 1 the layer is left as it is.
"""

from __future__ import annotations

import copy
from types import MethodType

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer


def split_tokens_over_tp(layer: MoELayer) -> None:
    """Make a built MoELayer split its tokens over its TP ranks (a no-op at TP 1). Its methods
    are replaced on the instance, not by a subclass: Megatron's TransformerLayer hands its
    process groups only to the MoELayer class itself."""
    if layer.tp_group.size() == 1:
        return
    # MoELayer.forward reads config.sequence_parallel only to refuse training without it; the
    # router, experts and dispatcher were built with (and keep) the model's config
    layer.config = copy.copy(layer.config)
    layer.config.sequence_parallel = True
    # the router's load-balancing and z losses count tokens over its tp_cp group, as if the TP
    # ranks held different tokens (sequence parallelism): here they hold the same ones, so the
    # count is over the context-parallel ranks only (else both losses, and their gradients,
    # come out 1/TP of the TP 1 value)
    layer.router.tp_cp_group = parallel_state.get_context_parallel_group()
    layer.preprocess = MethodType(_preprocess, layer)
    layer.postprocess = MethodType(_postprocess, layer)


def _preprocess(self: MoELayer, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    split = self.tp_group.size()
    self._split_shape = hidden_states.shape  # [s, b, h]; probs and routes [s * b, experts], the same order
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    pad = -hidden_states.shape[0] % split
    if pad:
        hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
        probs = torch.nn.functional.pad(probs, (0, 0, 0, pad))
        routing_map = torch.nn.functional.pad(routing_map, (0, 0, 0, pad))  # False: no expert
    rows = hidden_states.shape[0] // split
    start = self.tp_group.rank() * rows
    return MoELayer.preprocess(self, scatter_to_sequence_parallel_region(hidden_states, group=self.tp_group),
                               scatter_to_sequence_parallel_region(probs, group=self.tp_group),
                               routing_map[start:start + rows])


def _postprocess(self: MoELayer, output: torch.Tensor, shared_expert_output):
    output = MoELayer.postprocess(self, output, None)
    # every TP rank's gradient of the output is whole: the backward keeps this rank's rows
    output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=self.tp_group)
    shape = self._split_shape
    output = output[:shape[0] * shape[1]].view(shape)
    # a shared expert (Qwen3.5-MoE) ran on all the tokens as a dense TP MLP (its output whole on
    # every TP rank): it joins after the gather
    return output if shared_expert_output is None else output + shared_expert_output
