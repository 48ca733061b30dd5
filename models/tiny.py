"""Tiny models built offline: tokenizer, config, random weights and processors.

No model hub is reachable on the machines this project tests on, so every test and the CPU demo
runs on a model this module builds from nothing. The result is a normal Hugging Face directory
that transformers and vLLM both load, and it accepts images and videos.

Builds are deterministic for (kind, seed) and cached: `tiny_model_dir()` builds once per machine.
Which kinds exist, and their architecture, is each model family's (`ModelFamily.tiny_kinds`,
`make_tiny`; e.g. models/qwen2vl/tiny.py); this module holds what they share: the tokenizer and
chat template, the sizes, and the cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Bump when the architecture, tokenizer or processors below change: it invalidates caches.
FACTORY_VERSION = 2

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's chat format: media become <|vision_start|><|image_pad|><|vision_end|> in place.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Words the synthetic data and judge prompts use, so the tokenizer has short codes for them.
_WORDS = (
    "red green blue yellow purple orange white black gray pink cyan brown "
    "circle square triangle star shape shapes object objects ball box "
    "left right up down moving moves still static direction "
    "how many what which colour color is are the a an of in on this image video picture "
    "count there answer question response correct incorrect yes no score verdict judge "
    "final grade the answer is you see does match true false one two three four five six "
    "seven eight nine ten zero"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Sizes chosen so vLLM's CPU kernels accept them: text head_dim 64, mrope sums to 32."""

    kind: str = "policy"
    seed: int = 0
    vocab_size: int = 1024  # BPE merges + bytes; special tokens are appended after
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2  # tensor parallelism up to 2 needs at least 2 KV heads
    intermediate_size: int = 256
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    lm_head_std: float = 0.5  # large, so sampled responses differ from each other
    # Processor limits: small images keep the tiny model's sequences short.
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 64
    video_max_pixels: int = 28 * 28 * 16


def _spec_for(kind: str, seed: int) -> TinySpec:
    from models.family import family_for_tiny_kind

    family_for_tiny_kind(kind)  # an unknown kind: an error naming the known ones
    # The judge reads longer prompts (question + response + rubric): one more layer.
    if kind == "judge":
        return TinySpec(kind=kind, seed=seed, num_layers=3)
    return TinySpec(kind=kind, seed=seed)


def _version(kind: str) -> str:
    """The cache version of a kind (its family's `tiny_kinds`): FACTORY_VERSION and the family's own."""
    from models.family import family_for_tiny_kind

    return family_for_tiny_kind(kind).tiny_kinds[kind]


def _training_corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(1234)  # the tokenizer is the same for every seed and kind
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice(["?", ".", "!", ":", ""]))
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TinySpec.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def token_ids(ids: dict[str, int]) -> dict:
    """The top-level config's special token ids (every tiny architecture)."""
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])


def text_config(spec, vocab: int, ids: dict[str, int]) -> dict:
    """The language model's settings, the same for the Qwen2-VL and Qwen2.5-VL tiny models."""
    head_dim = spec.hidden_size // spec.num_heads
    return dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def build_tiny_model(out_dir: str | Path, kind: str = "policy", seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Build the tiny model of `kind` (its family's `make_tiny`) into `out_dir` (created; must
    not exist or be empty), with the stamp `yatt_tiny.json`. `spec` overrides the kind's sizes
    (e.g. a wider model for benchmarks; not cached by `tiny_model_dir`)."""
    from models.family import family_for_tiny_kind

    family = family_for_tiny_kind(kind)
    spec = spec or _spec_for(kind, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = family.make_tiny(out, kind, spec)
    (out / "yatt_tiny.json").write_text(json.dumps({"factory_version": FACTORY_VERSION, **stamp,
                                                    "version": family.tiny_kinds[kind]}, indent=1))
    return out


def save_model(out: Path, spec: "TinySpec", model, ids: dict[str, int], perturb_norms: bool) -> None:
    import torch

    from models.hf_io import save_pretrained_on_any_rank

    model = model.to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, spec.lm_head_std)  # a larger init makes sampled outputs vary
        if perturb_norms:
            # RMSNorm weights start at 1: perturb them (and the zero biases) so that conversion
            # mistakes that swap or drop them show up in parity
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name or "ln_q" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    save_pretrained_on_any_rank(model, out)


_ESSENTIAL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json")


def is_built(path: str | Path, kind: str, seed: int) -> bool:
    stamp = Path(path) / "yatt_tiny.json"
    if not stamp.is_file() or not all((Path(path) / f).is_file() for f in _ESSENTIAL_FILES):
        return False
    meta = json.loads(stamp.read_text())
    # stamps of before the family layout have no "version": their factory version is it
    version = meta.get("version", str(meta.get("factory_version")))
    return (meta.get("factory_version"), meta.get("kind"), meta.get("seed"), version) == (
        FACTORY_VERSION,
        kind,
        seed,
        _version(kind),
    )


def make_tiny_model(out_dir: str | Path, kind: str = "policy", seed: int = 0,
                    replace_broken: bool = False) -> tuple[Path, bool]:
    """Build into `out_dir` unless it already holds this (kind, seed). Returns (path, built).

    Concurrent callers (several ranks, several test workers) wait on a file lock while the first
    one builds, then reuse its result. The build goes to a sibling temporary directory renamed
    into place at the end, so an interrupted build never leaves a directory that looks complete.
    A directory that holds something else is an error, unless `replace_broken` (our own cache)
    says to rebuild it.
    """
    out = Path(out_dir)
    if is_built(out, kind, seed):
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(out, kind, seed):  # another caller built it while we waited
            return out, False
        if out.exists() and any(out.iterdir()):
            if not replace_broken:
                raise FileExistsError(f"{out} exists and does not hold a tiny {kind} model with seed {seed}; "
                                      "pick an empty or new directory")
            shutil.rmtree(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            build_tiny_model(tmp, kind=kind, seed=seed)
            if not is_built(tmp, kind, seed):  # never rename an incomplete build into the cache
                raise RuntimeError(f"building the tiny {kind} model left {tmp} incomplete (missing one of "
                                   f"yatt_tiny.json, {', '.join(_ESSENTIAL_FILES)})")
            if out.exists():
                out.rmdir()  # empty, checked above
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, True


def cache_root() -> Path:
    return Path(os.environ.get("YATT_MM_CACHE", Path.home() / ".cache" / "yatt-mm"))


def tiny_model_dir(kind: str = "policy", seed: int = 0) -> Path:
    """The cached tiny model for (kind, seed), built on first use."""
    path = cache_root() / "tiny" / f"{kind}-seed{seed}-v{_version(kind)}"
    return make_tiny_model(path, kind=kind, seed=seed, replace_broken=True)[0]


# For benchmarks: the tiny tokenizer and processors, widths where the layers' matmuls (not
# Python overhead) take the time: ~36M parameters, 8 text layers, 4 vision blocks.
WIDE = TinySpec(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=2048, num_layers=8,
                vision_depth=4, vision_embed_dim=256, vision_heads=4)


def wide_model_dir() -> Path:
    """The cached WIDE policy, built on first use (a few seconds)."""
    path = cache_root() / "wide" / f"policy-v{_version('policy')}"
    if not (path / "yatt_tiny.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".wide.lock", "w") as lock:  # one builder; the others wait, then reuse
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path / "yatt_tiny.json").is_file():
                tmp = Path(tempfile.mkdtemp(prefix=".wide.", dir=path.parent))
                build_tiny_model(tmp, spec=WIDE)
                os.rename(tmp, path)
    return path
