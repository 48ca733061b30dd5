"""Megatron-Core TransformerConfig settings shared by the model families (models/family.py):
activation recompute, the plain (unfused) kernels, pipeline stages of variable shape."""

from __future__ import annotations

import torch


# Activation recompute: "selective" recomputes each layer's core attention in the backward pass
# (its softmax probabilities are the largest activations of long sequences), "full" the whole of
# every layer (only the layers' inputs are kept). Gradients are the same; memory is traded for compute.
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def common(dtype: torch.dtype, tp: int, recompute: str = "none") -> dict:
    """Megatron TransformerConfig settings every model here uses."""
    # Fusions need Apex/TE or CUDA kernels; the plain paths are exact and work everywhere.
    return dict(**RECOMPUTE[recompute],
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def params_to(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Every floating-point parameter of `model` in `dtype` (its params_dtype). Megatron builds
    torch's norms (WrappedTorchNorm, when Transformer Engine and Apex are absent) in float32
    whatever params_dtype says, and leaves the cast to its Float16Module wrapper, which yatt-mm
    does not use. CUDA's layer_norm refuses bf16 input with a float32 weight ("expected scalar
    type BFloat16 but found Float"); the CPU's accepts it. Buffers (rotary frequencies) stay."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def pipeline_settings(pp: int, layers=()) -> dict:
    """Megatron settings of a language model split over `pp` pipeline stages: every micro-batch
    has its own shape (the schedule sends shapes before tensors). Megatron accepts variable
    lengths only beside the all-to-all MoE dispatcher, which a dense model never runs. With
    `layers` (language layers per stage, models/stages.py), Megatron's layout places them."""
    from models.stages import megatron_layout

    if pp == 1:
        return {}
    return dict(pipeline_model_parallel_size=pp, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                **({"pipeline_model_parallel_layout": megatron_layout(layers)} if layers else {}))


def language_transformer_config(spec, dtype: torch.dtype, tp: int, recompute: str, pp: int, layers=(), **arch):
    """The TransformerConfig of a family's language model: Megatron's GPT with M-RoPE
    (`spec.mrope_section`), RMSNorm, a gated SiLU MLP and no linear biases, over `tp` tensor-
    and `pp` pipeline-parallel ranks; `arch`: what the family sets beside (QKV bias, QK norm)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **pipeline_settings(pp, layers),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        mrope_section=list(spec.mrope_section),
        **arch,
        **common(dtype, tp, recompute),
    )
