"""`--engine ray`: the same `process` step as Ray Data tasks, for corpora bigger than one
machine. Items go in as rows, results come back in input order (`preserve_order`), and this
process writes the shards exactly as the local engine does, so both engines give the same bytes.

Shards are written by the driver: on a cluster, OUT should be storage the driver can write
(local disk or a shared file system); the decode and encode work, the expensive part, runs on
the cluster. Ray is an optional extra: `pip install 'yatt-mm[ray]'`."""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict
from typing import Iterator

from dataio.prep.inputs import Item
from dataio.prep.work import PrepOptions, WorkResult, process


def _require_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise SystemExit("prep --engine ray needs Ray Data: pip install 'yatt-mm[ray]' (or 'ray[data]')") from None
    return ray


def _process_row(row: dict, opts: PrepOptions) -> dict:
    fields = json.loads(row["item"])
    item = Item(**{**fields, "extra": tuple(tuple(x) for x in fields["extra"])})
    res = process(int(row["index"]), item, opts)
    # results are our own dataclasses going from our Ray workers to our driver
    return {"index": int(row["index"]), "result": pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)}


def ray_results(todo: list[tuple[int, Item]], opts: PrepOptions, workers: int,
                address: str | None = None) -> Iterator[WorkResult]:
    ray = _require_ray()
    started_here = False
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": max(1, workers)}
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, **kw)
        started_here = True
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        rows = [{"index": i, "item": json.dumps(asdict(it))} for i, it in todo]
        if not rows:
            return
        ds = ray.data.from_items(rows, override_num_blocks=min(len(rows), max(1, workers) * 8))
        ds = ds.map(_process_row, fn_kwargs={"opts": opts}, num_cpus=1)
        expect = todo[0][0]
        for row in ds.iter_rows():
            res = pickle.loads(row["result"])
            if res.index != expect:
                raise RuntimeError(f"ray engine: result {res.index} arrived where {expect} was due (order not kept)")
            expect += 1
            yield res
    finally:
        if started_here:
            ray.shutdown()
