"""A torchrun entry point that runs `yatt-mm rl` with torch.distributed's collectives wrapped,
and writes, per rank, every collective issued from yatt-mm's own code with the group it passed
(and the shape of its tensor: a context-parallel gather shows the rank's chunk length).

The rule it checks (issue: the GPU path correct by design): a collective called from `yatt_mm/`
moves CPU tensors, so it must name a gloo group made by `models.comm` for them; one called from
`models/` moves device tensors, so it must name an accelerator group. An implicit (default)
group is a violation either way: on GPUs it is NCCL, which refuses CPU tensors.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/audit_collectives.py \
        OUT_DIR [yatt-mm rl arguments]
"""

import functools
import inspect
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "batch_isend_irecv", "monitored_barrier")  # isend/irecv: P2POp checks their identity; batch_isend_irecv is audited
calls: list[dict] = []


def _caller() -> tuple[str | None, str]:
    """The first frame outside torch, as a path relative to the repo (None: someone else's), and
    its function's name."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return None, ""
    path = Path(frame.f_code.co_filename).resolve()
    where = str(path.relative_to(ROOT)) + f":{frame.f_lineno}" if path.is_relative_to(ROOT) else None
    return where, frame.f_code.co_name


def _groups(name: str, bound: inspect.BoundArguments) -> list:
    if name == "batch_isend_irecv":
        return [op.group for op in bound.arguments["p2p_op_list"]]
    return [bound.arguments.get("group")]


def _wrap(name: str):
    original = getattr(dist, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def audited(*args, **kwargs):
        where, function = _caller()
        if where and where.split("/")[0] in ("yatt_mm", "models"):
            from models.comm import is_cpu_group

            bound = signature.bind(*args, **kwargs)
            tensor = bound.arguments.get("tensor")  # this rank's part (e.g. its CP chunks of a gather)
            shape = list(tensor.shape) if hasattr(tensor, "shape") else None
            for group in _groups(name, bound):
                kind = "implicit" if group is None or group is dist.group.WORLD else (
                    "cpu" if is_cpu_group(group) else "accelerator")
                calls.append({"op": name, "where": where, "function": function, "group": kind, "shape": shape})
        return original(*args, **kwargs)

    setattr(dist, name, audited)


def main() -> None:
    out_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in COLLECTIVES:
        _wrap(name)
    from yatt_mm.rl.train import main as rl_main

    rank = os.environ["RANK"]
    try:
        code = rl_main(argv)
    finally:
        (out_dir / f"collectives_rank{rank}.json").write_text(json.dumps(calls))
    sys.exit(code)


if __name__ == "__main__":
    main()
