"""The GPU path in one process on one GPU, checked and measured; `scripts/gpu_check.sh` runs it.

A Qwen2-VL with the real 2B model's widths (text 1536 wide, 12 heads / 2 KV heads, MLP 8960,
vocabulary 151,936; vision tower 1280 wide, 16 heads, MLP x4) and 2 layers each, random weights,
built here (no hub). Then, on the GPU (`--cpu`: the same steps on the CPU, where the CUDA-only
parts are skipped and reported as such):

1. parity: Megatron's logits vs transformers' on the same weights and inputs, fp32 and bf16;
2. RL steps: GRPO updates through the real `Actor` and `VLMTrainer`, torch.distributed with one
   rank (NCCL on the GPU) and the loss's token counts over `models.comm`'s gloo group beside it;
3. offload: the trainer released to host memory and back, bit for bit, device memory measured;
4. speed: training tokens/s and peak GPU memory, Megatron trainer vs transformers + AdamW, on
   the same batch and loss.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

import models  # noqa: E402,F401 - the CPU runtime hooks (none act on a GPU machine but torchvision's)
import torch  # noqa: E402

# Qwen2-VL-2B-Instruct's widths (its config.json), 2 layers each instead of 28 and 32; "small"
# keeps its head sizes (text 128, vision 80) at a third of the widths and a fifth of the
# vocabulary, for the CPU run (2 cores, 24 GB).
WIDTHS = {
    "2b": (dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                vocab_size=151936, mrope_section=[16, 24, 24]),
           dict(embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536)),
    "small": (dict(hidden_size=512, intermediate_size=2816, num_attention_heads=4, num_key_value_heads=1,
                   vocab_size=32768, mrope_section=[16, 24, 24]),
              dict(embed_dim=320, num_heads=4, mlp_ratio=4, hidden_size=512)),
}


def build_model(out: Path, widths: str = "2b", layers: int = 2) -> Path:
    """An HF Qwen2-VL directory: the offline tiny tokenizer and processors (their token ids sit
    inside the 2B vocabulary), the given widths, random weights."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from models.qwen2vl.tiny import save_processor
    from models.tiny import SPECIAL_TOKENS, TinySpec, build_tokenizer, token_ids

    text_w, vision_w = WIDTHS[widths]
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=text_w["vocab_size"], hidden_size=text_w["hidden_size"],
                intermediate_size=text_w["intermediate_size"], num_hidden_layers=layers,
                num_attention_heads=text_w["num_attention_heads"], num_key_value_heads=text_w["num_key_value_heads"],
                max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": text_w["mrope_section"]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=layers, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, **vision_w)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **token_ids(ids))
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    # images up to 448x448 (256 merged tokens), as a real 2B run would see
    save_processor(out, TinySpec(max_pixels=448 * 448), tokenizer, Qwen2VLProcessor)
    return out


def rl_samples(processor, n_groups: int, n: int, response_tokens: int, seed: int = 0):
    """GRPO groups as the controller builds them: a prompt with an image, n responses of random
    tokens, rewards 0/1 with group-relative advantages."""
    import numpy as np
    from PIL import Image

    from yatt_mm.rl.advantages import advantages
    from yatt_mm.rl.samples import TrainSample

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    vocab = len(processor.tokenizer) - 20  # ordinary tokens, not the special ones at the end
    out = []
    for g in range(n_groups):
        image = Image.fromarray(np_rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
        enc = processor(text=[processor.apply_chat_template(msgs, add_generation_prompt=True)], images=[image],
                        return_tensors="pt")
        prompt = enc["input_ids"][0]
        rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(n)])
        adv = advantages("grpo", rewards, [f"g{g}"] * n)
        for i in range(n):
            ids = torch.cat([prompt, torch.randint(0, vocab, (response_tokens,), generator=torch.Generator().manual_seed(g * 97 + i))])
            mask = torch.zeros(ids.numel())
            mask[prompt.numel() - 1 : -1] = 1.0
            out.append(TrainSample(input_ids=ids, loss_mask=mask, rollout_logprobs=torch.zeros(ids.numel()),
                                   advantage=float(adv[i]), reward=float(rewards[i]), group_id=f"g{g}",
                                   pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]))
    return out


def parity(hf_dir: str, device: torch.device, dtype: torch.dtype) -> float:
    """Max |logit difference| of Megatron vs transformers over the built-in probes (text, image,
    two images, video), both in `dtype` on `device`."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from models.family import family_of, read_spec
    from models.inputs import VLMInputs
    from models.qwen2vl.parity import probes

    spec = read_spec(hf_dir)
    ours = family_of(spec).build_model(spec, dtype, 1).to(device).eval()
    family_of(spec).load_hf_into(ours, hf_dir, 0, 1)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    worst = 0.0
    for messages, media in probes().values():
        batch = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                          return_tensors="pt", **media)
        with torch.no_grad():
            ref = hf(**{k: v.to(device) for k, v in batch.items()}).logits.float()
            got = ours(VLMInputs.from_processor(spec, dict(batch)).to(device)).float()
        worst = max(worst, float((ref - got).abs().max()))
    del ours, hf
    _free(device)
    return worst


def rl_steps(hf_dir: str, dtype: str, steps: int, n_groups: int) -> tuple[dict, object, list]:
    """GRPO steps through the real Actor: 2 PPO mini-batches a step (an old-logprob pass, then the
    clipped loss). No vLLM on the check machine: its logprobs are absent, so the sampler
    correction and the trainer/sampler gap guard are off here (the CPU tests cover both)."""
    from transformers import AutoProcessor

    from models.trainer import TrainerConfig, VLMTrainer
    from yatt_mm.rl.actor import Actor
    from yatt_mm.rl.algorithms import AlgorithmConfig

    trainer = VLMTrainer(hf_dir, TrainerConfig(dtype=dtype, lr=1e-5, offload="always"))
    processor = AutoProcessor.from_pretrained(hf_dir)
    algorithm = AlgorithmConfig(mini_batches=2)
    algorithm.rollout_correction.level = "none"  # random tokens: no sampler to correct for
    actor = Actor(trainer, algorithm, micro_batch_tokens=4096,
                  pad_id=processor.tokenizer.pad_token_id, max_logprob_diff=float("inf"))
    samples = rl_samples(processor, n_groups, 4, 64)
    losses, changed = [], []
    for _ in range(steps):
        minis = actor.prepare(samples)
        actor.old_logprobs(minis)
        actor.batch_advantages(minis)
        m = actor.update(minis)
        losses.append(m["train/loss"])
        changed.append(m["train/weights_checksum_after"] != m["train/weights_checksum_before"])
    return {"rl_losses": losses, "rl_weights_changed_every_step": all(changed),
            "rl_grad_norm": m["train/grad_norm"]}, actor, samples


def offload_round_trip(trainer, device: torch.device) -> dict:
    from models.offload import optimizer_tensors

    def snapshot():
        return [t.detach().clone().cpu() for t in list(trainer.module.parameters()) + optimizer_tensors(trainer.optimizer)]

    before, resident = snapshot(), trainer.device_bytes()
    allocated = _allocated(device)
    t0 = time.perf_counter()
    trainer.release("none")
    release_s = time.perf_counter() - t0
    freed = allocated - _allocated(device)
    t0 = time.perf_counter()
    trainer.acquire("all")
    acquire_s = time.perf_counter() - t0
    after = snapshot()
    return {"offload_bitwise": all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after),
            "offload_trainer_gb": resident / 2**30, "offload_freed_gpu_gb": freed / 2**30 if device.type == "cuda" else None,
            "offload_seconds": release_s, "reload_seconds": acquire_s}


def speed(hf_dir: str, actor, samples, device: torch.device, dtype: str, rounds: int) -> dict:
    """Tokens/s of one training step on the same micro-batches and token-mean loss: the Megatron
    trainer vs transformers' model + torch AdamW (fp32 weights, bf16 autocast on a GPU)."""
    from transformers import Qwen2VLForConditionalGeneration

    trainer = actor.trainer
    mbs = actor.micro_batches(samples)
    tokens = sum(int(mb.inputs.attention_mask.sum()) for mb in mbs)
    target = sum(float(mb.extra["loss_mask"].sum()) for mb in mbs)

    def megatron_step():
        trainer.train_step(mbs, lambda lp, mb: (-(lp * mb.extra["loss_mask"]).sum() / target, {}))

    result = {"tokens_per_step": tokens}
    result |= _timed("megatron", megatron_step, tokens, rounds, device)
    trainer.release("none")  # out of the way of the baseline, as between RL phases
    hf = Qwen2VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
    image_token = hf.config.image_token_id

    def hf_step():
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            x = mb.inputs.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = hf(input_ids=x.input_ids, attention_mask=x.attention_mask, pixel_values=_per_occurrence(x),
                            image_grid_thw=x.image_grid_thw,
                            mm_token_type_ids=(x.input_ids == image_token).int()).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.labels.to(device).unsqueeze(-1)).squeeze(-1)
            (-(lp * mb.extra["loss_mask"].to(device)).sum() / target).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    result |= _timed("transformers", hf_step, tokens, rounds, device)
    result["ratio_to_transformers"] = result["megatron_tokens_per_s"] / result["transformers_tokens_per_s"]
    return result


def _per_occurrence(x) -> torch.Tensor:
    """The micro-batch's pixel values with a copy per image occurrence, as transformers takes them
    (the trainer encodes a group's shared image once; `VLMInputs.image_sources`)."""
    if x.image_sources is None:
        return x.pixel_values
    sizes: dict[int, int] = {}
    for src, grid in zip(x.image_sources.tolist(), x.image_grid_thw):
        sizes.setdefault(src, int(grid.prod()))
    distinct = torch.split(x.pixel_values, [sizes[i] for i in range(len(sizes))])
    return torch.cat([distinct[s] for s in x.image_sources.tolist()])


def _timed(name: str, step, tokens: int, rounds: int, device: torch.device) -> dict:
    step()  # warm-up (allocations, kernels)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        _sync(device)
        best = max(best, tokens / (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {f"{name}_tokens_per_s": best, f"{name}_peak_gpu_gb": peak}


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: run everything that does not need CUDA")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--widths", choices=sorted(WIDTHS), default=None, help="default: 2b on a GPU, small with --cpu")
    ap.add_argument("--steps", type=int, default=3, help="RL steps")
    ap.add_argument("--groups", type=int, default=4, help="GRPO groups of 4 responses per step")
    ap.add_argument("--rounds", type=int, default=3, help="timed training steps per trainer")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no GPU visible; run with --cpu for the CPU part", file=sys.stderr)
        return 2
    from models.comm import init_parallel

    start = time.perf_counter()
    groups = init_parallel(1)  # NCCL on the GPU, plus gloo beside it (models/comm.py)
    device = groups.device
    dtype = "fp32" if args.cpu else "bf16"
    widths = args.widths or ("small" if args.cpu else "2b")
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "widths": widths, "layers": args.layers, "train_dtype": dtype,
                    "backend": torch.distributed.get_backend()}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(build_model(Path(tmp) / f"qwen2vl-{widths}-widths", widths, args.layers))
        report["params_m"] = sum(p.numel() for p in _safetensors(hf_dir)) / 1e6
        print(f"built {report['params_m']:.0f}M-parameter Qwen2-VL ({widths} widths) in {time.perf_counter() - start:.0f}s",
              flush=True)
        report["parity_fp32_max_diff"] = parity(hf_dir, device, torch.float32)
        report["parity_bf16_max_diff"] = parity(hf_dir, device, torch.bfloat16)
        print(f"parity fp32 {report['parity_fp32_max_diff']:.2e}, bf16 {report['parity_bf16_max_diff']:.2e}", flush=True)
        rl, actor, samples = rl_steps(hf_dir, dtype, args.steps, args.groups)
        report |= rl
        print(f"RL steps: losses {rl['rl_losses']}", flush=True)
        report |= offload_round_trip(actor.trainer, device)
        report |= speed(hf_dir, actor, samples, device, dtype, args.rounds)
    report["seconds"] = time.perf_counter() - start
    report["ok"] = bool(report["parity_fp32_max_diff"] < 1e-3 and report["rl_weights_changed_every_step"]
                        and report["offload_bitwise"] and all(map(_finite, report["rl_losses"])))
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


def _safetensors(hf_dir: str):
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors")).values()


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


if __name__ == "__main__":
    raise SystemExit(main())
