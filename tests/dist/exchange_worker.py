"""Two gloo ranks balance a long-tail batch and exchange samples point to point."""

import json
import random
import sys

import torch
import torch.distributed as dist

from yatt_mm.rl.balance import imbalance, loads_of, plan_moves
from yatt_mm.rl.distributed import exchange


def main(rank: int, world: int, port: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = random.Random(0)  # same on every rank: this is the shared metadata
    lengths = [int(rng.paretovariate(1.2) * 20) + 1 for _ in range(24)]
    owner = [0 if i < 18 else 1 for i in range(24)]  # rank 0 got the long tail
    new_owner, moves = plan_moves([float(n) for n in lengths], owner, world)
    mine = {i: ({"input_ids": torch.arange(lengths[i]) + i, "pixels": torch.full((2, 3), float(i))},
                {"key": f"s{i}"}) for i in range(24) if owner[i] == rank}
    received = exchange({i: mine[i] for i in mine}, moves, rank, dist.group.WORLD)
    kept = {i: v for i, v in mine.items() if new_owner[i] == rank}
    final = {**kept, **received}
    ok = sorted(final) == [i for i in range(24) if new_owner[i] == rank] and all(
        torch.equal(t["input_ids"], torch.arange(lengths[i]) + i) and m["key"] == f"s{i}"
        for i, (t, m) in final.items())
    result = {"rank": rank, "ok": ok, "moves": len(moves), "received": len(received),
              "before": imbalance(loads_of(lengths, owner, world)),
              "after": imbalance(loads_of(lengths, new_owner, world))}
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, out_path = sys.argv[1], sys.argv[2]
    torch.multiprocessing.spawn(main, args=(2, port, out_path), nprocs=2)
