import json
import subprocess
import sys
from pathlib import Path

import torch

from models.comm import pack, unpack
from models.comm import free_port


def test_pack_roundtrip_keeps_dtypes_shapes_and_metadata():
    tensors = {"ids": torch.arange(5), "px": torch.randn(2, 3, dtype=torch.float32), "m": torch.ones(4, dtype=torch.bool)}
    got, meta = unpack(pack(tensors, {"key": "abc", "answer": "red"}))
    assert meta == {"key": "abc", "answer": "red"}
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_two_ranks_balance_and_exchange_point_to_point(tmp_path):
    worker = Path(__file__).parents[1] / "dist" / "exchange_worker.py"
    out = tmp_path / "result"
    proc = subprocess.run([sys.executable, str(worker), str(free_port()), str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert all(r["ok"] for r in results)
    assert results[0]["moves"] > 0
    assert sum(r["received"] for r in results) == results[0]["moves"]
    assert results[0]["after"] < results[0]["before"]
