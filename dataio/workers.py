"""The decoders' parallel map: `ordered_thread_map` (the thread workers of `DataReader`) and the
shutdown of a torchdata.nodes chain (its process workers)."""

from __future__ import annotations

import threading
from typing import Any, Iterator


def ordered_thread_map(fn, items: list, workers: int, window: int, join_timeout_s: float = 70.0) -> Iterator:
    """fn(item) for each item on `workers` threads, yielded in item order. At most `window`
    items are in flight (being decoded, or decoded and waiting for the consumer), so memory is
    bounded. Threads wait on one condition (no polling), and closing the generator stops them
    after their current item. (torchdata's thread ParallelMapper does the same with three more
    queue hops, polls with 0.1 s timeouts and took ~100 ms to stop at every epoch end.)"""
    n = len(items)
    window = max(1, window)
    cond = threading.Condition()
    done: dict[int, tuple[bool, Any]] = {}
    st = {"next": 0, "consumed": 0, "stop": False}

    def work() -> None:
        while True:
            with cond:
                while not st["stop"] and st["next"] < n and st["next"] - st["consumed"] >= window:
                    cond.wait()
                if st["stop"] or st["next"] >= n:
                    return
                pos = st["next"]
                st["next"] += 1
            try:
                res = (True, fn(items[pos]))
            except BaseException as e:  # handed to the consumer
                res = (False, e)
            with cond:
                done[pos] = res
                cond.notify_all()

    threads = [threading.Thread(target=work, daemon=True, name=f"yatt-mm-decode-{k}") for k in range(min(workers, n))]
    for t in threads:
        t.start()
    try:
        for pos in range(n):
            with cond:
                while pos not in done:
                    cond.wait()
                ok, val = done.pop(pos)
                st["consumed"] = pos + 1
                cond.notify_all()
            if not ok:
                raise val
            yield val
    finally:
        with cond:
            st["stop"] = True
            cond.notify_all()
        for t in threads:  # each finishes at most its current item (a video decode is time-limited)
            t.join(join_timeout_s)


def shutdown_nodes(obj, depth: int = 0) -> None:
    """torchdata.nodes stops its threads only in __del__; walk the node chain and stop them."""
    if obj is None or depth > 8:
        return
    for name in ("_it", "source"):
        shutdown_nodes(getattr(obj, name, None), depth + 1)
    stop = getattr(obj, "_shutdown", None)
    if callable(stop):
        try:
            stop()
        except Exception:
            pass
