"""The one place where yatt-mm adapts its libraries to a machine without a GPU, and to Megatron
without its optional CUDA libraries (Transformer Engine, fla).

Nothing here runs by itself: `models._hooks` calls `fix_torchvision_ops()` right before
torchvision is first imported, and `quiet_expected_warnings()` before megatron.core is first
imported, `patch_megatron_for_missing_kernels()` and (without a GPU) `patch_megatron_for_cpu()`
after it, in every process of the environment (see that module for why). The rollout engine calls
`set_vllm_cpu_defaults()` (and `name_vllm_cpu_shared_memory_per_job()` for a tensor-parallel
engine). On a machine with a CUDA GPU only the torchvision fix (when torchvision's native library
cannot load), the filter of megatron's deprecated collectives and the fallbacks for a missing
Transformer Engine or fla act.

Each shim below says in one line what it works around.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_keep_alive: list = []  # torch.library.Library objects must outlive this module's functions


def has_gpu() -> bool:
    return torch.cuda.is_available()


# --- torchvision -------------------------------------------------------------------------------


def fix_torchvision_ops() -> None:
    """PyPI's torchvision is a CUDA build: its `_C` fails to load beside the CPU torch, and then
    `import torchvision` dies on `register_fake("torchvision::nms")` for an operator nobody
    defined. Defining the two schemas first lets the pure-Python transforms import and work."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    if _torchvision_ops_defined():
        return
    lib_path = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if lib_path is not None:
        try:
            torch.ops.load_library(str(lib_path))
            return  # a torchvision that matches this torch: nothing to fix
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep_alive.append(lib)
    log.debug("torchvision native ops unavailable; defined nms/qnms schemas so it imports")


def _torchvision_ops_defined() -> bool:
    try:
        torch.ops.torchvision.nms.default  # noqa: B018 - raises when the op is not registered
        return True
    except (AttributeError, RuntimeError):
        return False


# --- vLLM ----------------------------------------------------------------------------------------


# The in-process, eager engine starts in ~5 s on CPU; the default (multiprocess + torch.compile)
# takes 65-138 s. These only set defaults: a user's environment wins.
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the caller's process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM's CPU default is far larger
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # binding to cores fights torch's own threads
    "TORCHDYNAMO_DISABLE": "1",  # no torch.compile on CPU: minutes of start-up for tiny models
    "HF_HUB_OFFLINE": "1",  # tiny models are built locally; never reach for a hub
}


def set_vllm_cpu_defaults() -> None:
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_set_num_threads_skipped_once)


def _say_once(text: str) -> logging.Filter:
    """A logger filter that lets the first record containing `text` through and drops the rest."""
    seen = []

    def once(record: logging.LogRecord) -> bool:
        if text not in str(record.msg):
            return True
        seen.append(True)
        return len(seen) == 1

    quiet = logging.Filter()
    quiet.filter = once
    return quiet


# vllm-cpu's worker replaces `torch.set_num_threads` by a no-op that warns on every call; vLLM
# itself then calls it twice around every multimodal request (`set_default_torch_num_threads` in
# its renderer), ~130 warnings per rank per step of the tiny demo. yatt-mm sets a role's threads
# through `torch._C.set_num_threads` (rl/cpu_pinning.py) and never calls the patched setter.
_set_num_threads_skipped_once = _say_once("doesn't allow to use `torch.set_num_threads`")


def name_vllm_cpu_shared_memory_per_job() -> None:
    """A tensor-parallel vllm-cpu engine inside torchrun ranks names its shared-memory segment
    after the init method, "//" for every env:// job: a second job on the host (or a killed
    job's leftovers) collides (errno 17). Prefix it with this job's torchrun run id and port."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    original = inspect.getattr_static(shm, "make_group_name").__func__
    if getattr(original, "_per_job", False):
        return
    job = f"yatt{os.environ.get('MASTER_PORT', '')}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"

    def make_group_name(communicator) -> str:
        return job + original(communicator).lstrip("/")

    make_group_name._per_job = True
    shm.make_group_name = staticmethod(make_group_name)


# --- Expected warnings ---------------------------------------------------------------------------


def quiet_expected_warnings() -> None:
    """Silence library warnings that are expected here and ask nothing of the user. Idempotent."""
    # megatron-core 0.16.1 calls torch.distributed.all_gather_into_tensor and reduce_scatter_tensor
    # (distributed/param_and_grad_buffer.py, tensor_parallel/, ...), which torch 2.13 deprecates for
    # all_gather_single / reduce_scatter_single, with a FutureWarning per call site. yatt-mm's own
    # code calls neither (tests/dist/audit_collectives.py records the collectives it issues).
    warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                            "deprecated", FutureWarning)
    # megatron-core 0.16.1's own default TransformerConfig.cuda_graph_scope="full" warns about itself
    # at every config ("full scope is deprecated"; it becomes [], the same scope); CUDA graphs stay off.
    warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
    if not has_gpu():
        # Transformer Engine and Apex are CUDA libraries: without a GPU, megatron's fallbacks to torch
        # (optimizers, multi_tensor_*, norms) are the only choice, announced by every process that
        # imports megatron.core.
        warnings.filterwarnings("ignore", "(Transformer Engine and )?Apex (are|is) not installed", UserWarning)


# --- Megatron-Core ------------------------------------------------------------------------------

# Each shim replaces a megatron function or method, or wraps one so that it runs under `_CudaAsCpu`
# (below), which is cheaper to read than a copy of the function with "cuda" edited out.
#
# Not shimmed, because it is not about CUDA: without TransformerEngine, CLIPViTModel's default
# `ln_pre_impl`/`ln_post_impl` is torch.nn.LayerNorm, which its `build_module(..., config=...)`
# cannot construct. Pass `megatron.core.transformer.torch_norm.WrappedTorchNorm` explicitly.

import contextlib  # noqa: E402 - this section's own imports
import functools  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Callable  # noqa: E402

from torch.overrides import TorchFunctionMode  # noqa: E402


def patch_megatron_for_cpu() -> None:
    """megatron-core 0.16.1 assumes CUDA in a few places; `_MEGATRON_SHIMS` patches each.

    For a process without a GPU, called once `megatron.core` has been imported (which already
    imports all but one of the modules patched here). Idempotent."""
    # Layers, rotary embeddings, the attention memory buffer and DDP's param/grad buffers allocate
    # on torch.cuda.current_device(), which asserts without CUDA. Patched on torch itself, as
    # megatron calls it through `torch.` in ~100 places; this runs only where there is no GPU.
    torch.cuda.current_device = _cpu_device
    _apply(_MEGATRON_SHIMS, _shimmed, "the CPU shims")


def _apply(patches: dict[str, Callable[[ModuleType], None]], done: set[str], what: str) -> None:
    """Each patch to its module, once a process (`done`); a module or name that is not where the
    patch expects it means another megatron-core than the one it is written for."""
    for name, patch in patches.items():
        if name in done:
            continue
        try:
            patch(importlib.import_module(name))
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"{what} are written for megatron-core 0.16.1: {exc}") from exc
        done.add(name)


_shimmed: set[str] = set()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class _CudaAsCpu(TorchFunctionMode):
    """While a wrapped megatron function runs: tensors made on "cuda" are made on the CPU,
    `.cuda()` leaves a tensor where it is, and `.type()` names a CPU tensor's type as its
    `torch.cuda.*Tensor` twin, the only names megatron's type checks accept."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _on_cpu(*names: str) -> Callable[[ModuleType], None]:
    """A shim that runs the module's `names` ("function" or "Class.method") under `_CudaAsCpu`."""

    def shim(module: ModuleType) -> None:
        for name in names:
            if "." not in name:
                _rebind(module, name, _run_on_cpu(getattr(module, name)))
                continue
            cls_name, attr = name.split(".")
            cls = getattr(module, cls_name)
            raw = inspect.getattr_static(cls, attr)
            if isinstance(raw, (staticmethod, classmethod)):
                setattr(cls, attr, type(raw)(_run_on_cpu(raw.__func__)))
            else:
                setattr(cls, attr, _run_on_cpu(raw))

    return shim


class _TorchMakingCpuTensors:
    """`torch` as one megatron module sees it: `zeros(..., device="cuda")` and
    `tensor(..., device="cuda")` make CPU tensors; everything else is torch itself."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        return torch.zeros(*args, **_on_cpu_if_cuda(kwargs))

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **_on_cpu_if_cuda(kwargs))


def _on_cpu_if_cuda(kwargs: dict) -> dict:
    if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
        return {**kwargs, "device": "cpu"}
    return kwargs


class _TorchWithoutCudaSync:
    """`torch` as pipeline parallelism's p2p module sees it: `cuda.synchronize()` (called after
    every send/recv of shapes and, with batch_p2p_sync, of tensors) is a no-op; gloo's sends and
    receives of CPU tensors are complete when they return."""

    class cuda:  # noqa: N801 - stands in for torch.cuda
        synchronize = staticmethod(lambda *args, **kwargs: None)

        def __getattr__(self, name: str):
            return getattr(torch.cuda, name)

    cuda = cuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _run_on_cpu(func: Callable) -> Callable:
    @functools.wraps(func)
    def on_cpu(*args, **kwargs):
        with _CudaAsCpu():
            return func(*args, **kwargs)

    return on_cpu


def _rebind(module: ModuleType, name: str, new) -> None:
    """Replace `module.name` with `new`, also where other loaded megatron modules imported it."""
    old = getattr(module, name)
    for other in list(sys.modules.values()):
        if getattr(other, "__name__", "").startswith("megatron.") and vars(other).get(name) is old:
            setattr(other, name, new)


def _cpu_rng(random: ModuleType) -> None:
    # The RNG tracker (weight init, dropout, recompute) saves and forks CUDA generator states, and
    # model_parallel_cuda_manual_seed seeds CUDA: without a GPU the device generator is the CPU's.
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    random.CudaRNGStatesTracker.add = _cpu_tracker_add
    random.CudaRNGStatesTracker.fork = _cpu_tracker_fork
    seed_fn = random.model_parallel_cuda_manual_seed

    @functools.wraps(seed_fn)
    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        torch.manual_seed(seed)  # what its torch.cuda.manual_seed(seed) does on a GPU
        return seed_fn(seed, *args, **kwargs)

    _rebind(random, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add, keeping a CPU generator state seeded with `seed`."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self, name: str = "model-parallel-rng"):
    """CudaRNGStatesTracker.fork on the CPU generator, less the original's warning that the CPU
    state changed inside the fork (on CPU, every fork that draws a number changes it)."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state, orig_name = torch.get_rng_state(), self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not {name}")
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _cpu_checkpoint_worker(async_utils: ModuleType) -> None:
    # The persistent async checkpoint writer starts with torch.cuda.set_device(rank %
    # torch.cuda.device_count()): ZeroDivisionError without a GPU. It has no device to pin.
    caller = async_utils.PersistentAsyncCaller
    loop = inspect.getattr_static(caller, "async_loop").__func__

    @functools.wraps(loop)
    def async_loop(*args, **kwargs):
        saved = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            return loop(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved

    caller.async_loop = staticmethod(async_loop)


def _cpu_checkpoint_preload(filesystem_async: ModuleType) -> None:
    # The async checkpoint writer copies tensors to host memory with non_blocking=True and then
    # calls torch.cuda.synchronize(), which asserts without CUDA: copy blocking, nothing to wait on.
    writer = filesystem_async.FileSystemWriterAsync
    preload = inspect.getattr_static(writer, "preload_tensors").__func__

    @functools.wraps(preload)
    def preload_tensors(write_buckets, non_blocking=True):
        return preload(write_buckets, non_blocking=False)

    writer.preload_tensors = staticmethod(preload_tensors)


def _cpu_moe_dispatcher(token_dispatcher: ModuleType) -> None:
    # MoE, megatron-core 0.16.1. The all-to-all token dispatcher makes a torch.cuda.Stream in
    # __init__ (for its device-to-host copy of the split sizes) and enters it with
    # torch.cuda.stream(); without CUDA both fail. On the CPU there is one stream: the module
    # sees a torch whose cuda.Stream()/current_stream() give one no-op stand-in and whose
    # cuda.stream() is a null context.
    token_dispatcher.torch = _TorchWithOneCpuStream()
    # Its maybe_move_tensor_to_cpu turns the split sizes into numpy only for CUDA tensors; CPU
    # tensors stay tensors, which gloo's all_to_all_single rejects as split sizes (it takes lists).
    move = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


class _CpuStream:
    """One stand-in for the dispatcher's side stream and the current stream: gloo's collectives
    on CPU tensors are complete when they return, so there is nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self):
        return self  # an event that is already complete


class _TorchWithOneCpuStream:
    """`torch` as the MoE token dispatcher sees it (see `_cpu_moe_dispatcher`)."""

    class cuda:  # noqa: N801 - stands in for torch.cuda
        _stream = _CpuStream()
        Stream = staticmethod(lambda *args, **kwargs: _TorchWithOneCpuStream.cuda._stream)
        current_stream = staticmethod(lambda *args, **kwargs: _TorchWithOneCpuStream.cuda._stream)
        stream = staticmethod(lambda stream: contextlib.nullcontext())

        def __getattr__(self, name: str):
            return getattr(torch.cuda, name)

    cuda = cuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _moe_utils_without_te(moe_utils: ModuleType) -> None:
    # MoE, megatron-core 0.16.1 bug: moe_utils imports te_general_gemm and the fused_* kernels
    # only when Transformer Engine imports, but router_gating_linear tests `te_general_gemm is
    # not None` (NameError without TE, i.e. always on CPU). None is the code's own fallback.
    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _gated_delta_net_without_fla(gated_delta_net: ModuleType) -> None:
    # Qwen3.5's linear-attention layers, megatron-core 0.16.1: GatedDeltaNet refuses to build
    # without fla (flash-linear-attention: Triton kernels, which have no CPU backend) and takes
    # two functions from it. Where fla is missing they are replaced by pure-torch equals:
    # fla's l2norm by L2 normalisation over the last dim (transformers' own formula, so the
    # numerics match its Qwen3.5), and fla's chunked gated delta rule by Megatron's own
    # torch_chunk_gated_delta_rule (what it runs under deterministic_mode). The depthwise causal
    # conv already falls back to nn.Conv1d without causal_conv1d. Where fla is installed, nothing
    # changes. Needed with or without a GPU.
    if gated_delta_net.HAVE_FLA:
        return
    gated_delta_net.l2norm = _l2norm
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True


def _uncompiled(cls: type, name: str) -> None:
    # megatron-core 0.16.1 wraps a few small element-wise methods in `jit_fuser` (torch.compile
    # on torch >= 2.2): on the CPU their first call compiles for ~15 s (tiny Qwen3.5: the
    # DeltaNet's gated norm and the attention's output gate) to save microseconds. The method
    # itself, unwrapped, computes the same.
    method = cls.__dict__[name]
    setattr(cls, name, getattr(method, "_torchdynamo_orig_callable", method))


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over `dim`, as fla's l2norm and transformers' Qwen3.5 compute it."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _uneven_gather_on_gloo(mappings: ModuleType) -> None:
    # MoE under EP x TP, megatron-core 0.16.1: the all-to-all dispatcher all-gathers over TP the
    # tokens each TP rank received from its EP peers, a count per rank as the routing falls
    # (output_split_sizes), through torch.distributed.all_gather into unequal tensors, which
    # gloo refuses ("invalid tensor size"). Unequal counts are padded to the largest, gathered
    # as equal blocks and cut back: the same rows in the same order. Equal counts (and no
    # counts) take Megatron's own path.
    gather = mappings._gather_along_first_dim

    @functools.wraps(gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = torch.cat([input_, input_.new_zeros((rows - input_.shape[0], *input_.shape[1:]))])
        blocks = list(torch.empty((len(output_split_sizes) * rows, *input_.shape[1:]), dtype=input_.dtype,
                                  device=input_.device).split(rows))
        torch.distributed.all_gather(blocks, padded, group=group)
        return torch.cat([block[:n] for block, n in zip(blocks, output_split_sizes)])

    mappings._gather_along_first_dim = _gather_along_first_dim


def _cpu_clip_grads(clip_grads: ModuleType) -> None:
    # The grad norm, the clipping and the zero count run once per optimizer step over every
    # grad. Not run under `_CudaAsCpu`: that sent each of their torch calls through Python
    # (three a parameter; measured 1.7 ms of the tiny Qwen3-VL's 10 ms optimizer step). The norm
    # and the zero count need only their device="cuda" buffers made on the CPU, and Megatron's
    # fallback L2 norm (where models.optimizer has not replaced it) the mode for its own
    # device="cuda" result.
    clip_grads.torch = _TorchMakingCpuTensors()
    applier = clip_grads.multi_tensor_applier
    fallback_l2_norm = importlib.import_module("megatron.core.utils").local_multi_tensor_l2_norm

    @functools.wraps(applier)
    def multi_tensor_applier(op, *args):
        if op is not fallback_l2_norm:
            return applier(op, *args)
        with _CudaAsCpu():
            return applier(op, *args)

    clip_grads.multi_tensor_applier = multi_tensor_applier
    _rebind(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_on_cpu(clip_grads))


def _clip_grad_by_total_norm_on_cpu(clip_grads: ModuleType) -> Callable:
    """clip_grad_by_total_norm_fp32 for CPU grads. Megatron's asserts that each grad's `.type()`
    is "torch.cuda.FloatTensor", which a CPU grad passes only under `_CudaAsCpu` (three Python
    dispatches a parameter: .grad, .type(), .detach()); this one asserts float32 instead and
    otherwise does the same: the same grads, coefficient and module's scale kernel."""
    original = clip_grads.clip_grad_by_total_norm_fp32

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        grads = []
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is None:
                continue
            assert grad.dtype in allowed, f"clip_grad_by_total_norm_fp32: a {grad.dtype} grad"
            grads.append(clip_grads.to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
            clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads],
                                            clip_coeff)

    return clip_grad_by_total_norm_fp32


# module -> its shim. Modules and names as in megatron-core 0.16.1.
_MEGATRON_SHIMS: dict[str, Callable[[ModuleType], None]] = {
    "megatron.core.tensor_parallel.random": _cpu_rng,
    # Softmax attention makes its causal masks with device="cuda".
    "megatron.core.transformer.utils": _on_cpu(
        "get_default_causal_mask", "get_sliding_window_causal_mask"
    ),
    # The schedules count tokens in a device="cuda" tensor. Not run under `_CudaAsCpu`: that
    # would send every op of the forward and backward through Python (~30% of a step).
    "megatron.core.pipeline_parallel.schedules": lambda module: setattr(module, "torch", _TorchMakingCpuTensors()),
    # Grad norm and clipping make their buffers on "cuda" and assert torch.cuda.FloatTensor grads.
    "megatron.core.optimizer.clip_grads": _cpu_clip_grads,
    # The optimizers keep loss scales and inf flags on "cuda", accept only torch.cuda.*Tensor
    # parameters, and move offloaded state back with .cuda().
    "megatron.core.optimizer.optimizer": _on_cpu(
        "MegatronOptimizer.restore_from_cpu",
        "MixedPrecisionOptimizer.__init__",
        "Float16OptimizerWithFloat16Params.__init__",
        "FP32Optimizer.__init__",
    ),
    "megatron.core.optimizer.distrib_optimizer": _on_cpu("DistributedOptimizer.__init__"),
    # fp16's loss scaler keeps its scale on "cuda".
    "megatron.core.optimizer.grad_scaler": _on_cpu(
        "MegatronGradScaler.__init__",
        "DynamicGradScaler.__init__",
        "DynamicGradScaler.load_state_dict",
    ),
    # Pipeline parallelism: the p2p module waits on CUDA after its transfers, and with tied
    # embeddings the last stage moves its copy of the word embeddings with .cuda().
    "megatron.core.pipeline_parallel.p2p_communication": lambda module: setattr(module, "torch",
                                                                                _TorchWithoutCudaSync()),
    "megatron.core.models.common.language_module.language_module": _on_cpu(
        "LanguageModule.setup_embeddings_and_output_layer"),
    # The ViT moves its position ids with .cuda().
    "megatron.core.models.vision.clip_vit_model": _on_cpu("CLIPViTModel.__init__"),
    "megatron.core.dist_checkpointing.strategies.async_utils": _cpu_checkpoint_worker,
    "megatron.core.dist_checkpointing.strategies.filesystem_async": _cpu_checkpoint_preload,
    # Mixture-of-experts layers (Qwen3-VL-MoE): the token dispatcher's CUDA stream and gloo's
    # split sizes.
    "megatron.core.transformer.moe.token_dispatcher": _cpu_moe_dispatcher,
    # Qwen3.5: the gated DeltaNet's gated norm and gated attention's output gate, compiled on
    # first call (see _uncompiled)
    "megatron.core.ssm.gated_delta_net": lambda module: _uncompiled(module.GatedDeltaNet, "_apply_gated_norm"),
    "megatron.core.transformer.attention": lambda module: _uncompiled(module.Attention, "_apply_output_gate"),
    # MoE under EP x TP: the dispatcher's all-gather of uneven token counts over TP, which gloo refuses.
    "megatron.core.tensor_parallel.mappings": _uneven_gather_on_gloo,
}

# Fallbacks for Megatron's optional CUDA libraries, applied on every machine (a GPU one too)
# where the library is missing: each one is a no-op where it is installed.
_MEGATRON_FALLBACKS: dict[str, Callable[[ModuleType], None]] = {
    # MoE: a name moe_utils leaves undefined without Transformer Engine.
    "megatron.core.transformer.moe.moe_utils": _moe_utils_without_te,
    # Qwen3.5's gated DeltaNet layers: the pure-torch rule and L2 norm where fla is missing.
    "megatron.core.ssm.gated_delta_net": _gated_delta_net_without_fla,
}
_fallen_back: set[str] = set()


def patch_megatron_for_missing_kernels() -> None:
    """Megatron-Core's pure-torch paths where Transformer Engine or fla is not installed, on any
    machine: `_MEGATRON_FALLBACKS`. Called once `megatron.core` has been imported. Idempotent."""
    _apply(_MEGATRON_FALLBACKS, _fallen_back, "the fallbacks")
