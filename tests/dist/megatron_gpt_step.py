"""One Megatron-Core training step of a tiny GPT on CPU with gloo: checks that the CPU shims in
`models.runtime` let Megatron's model, DDP, optimizer and schedule run without a GPU.

    torchrun --nproc-per-node 2 tests/dist/megatron_gpt_step.py --tp 1 2   # DP=2, then TP=2 DP=1

Rank 0 prints one JSON line, a result per TP size: {"1": {"loss": ..., "params_identical": ...,
"params_changed": ..., ...}, "2": ...}; the sizes share one launch, Megatron's groups remade
between them.
`params_identical`: after the step, every data-parallel replica holds the same parameters bit for
bit, and so does every tensor-parallel rank for the parameters TP does not split (norms, some
biases). Exits 1 when, at any size, the loss is not finite, the step changed nothing, or replicas
disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import models  # noqa: F401 - first: installs the CPU shims before megatron is imported
import torch
import torch.distributed as dist

VOCAB = 64
SEQ = 16
MICRO_BATCH = 2
SEED = 1234


def build_model(tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        add_qkv_bias=True,  # Qwen2-like: GQA, RMSNorm, SwiGLU, rope, QKV bias
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(  # GPTModel sets model.model_type, which the schedule reads
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    )
    return config, model


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    # With labels, GPTModel returns the per-token loss [batch, seq]; attention_mask=None is causal.
    per_token_loss = model(tokens, position_ids, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return per_token_loss, loss_func


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


def same_on_all_ranks(tensor: torch.Tensor, group) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def step_case(tp: int, steps: int) -> tuple[dict, bool]:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(SEED)

    config, model = build_model(tp)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads  # else no DP grad all-reduce at all
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0), [model]
    )

    # Different data on each DP rank, the same within a TP group: the all-reduce has work to do.
    gen = torch.Generator().manual_seed(SEED + parallel_state.get_data_parallel_rank())
    before = flat(model.parameters())
    loss = math.nan
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([(batch[:, :-1], batch[:, 1:])]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step skipped")
        loss = float(losses[0]["lm loss"])
    after = flat(model.parameters())

    tp_replicated = [p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]
    params_identical = same_on_all_ranks(
        after, parallel_state.get_data_parallel_group()
    ) and same_on_all_ranks(flat(tp_replicated), parallel_state.get_tensor_model_parallel_group())
    params_changed = not torch.equal(before, after)
    ok = math.isfinite(loss) and params_changed and params_identical

    result = {
        "loss": loss,
        "grad_norm": grad_norm,
        "params_identical": params_identical,
        "params_changed": params_changed,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }
    parallel_state.destroy_model_parallel()
    return result, ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    results, all_ok = {}, True
    for tp in args.tp:
        results[str(tp)], ok = step_case(tp, args.steps)
        all_ok = all_ok and ok
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
