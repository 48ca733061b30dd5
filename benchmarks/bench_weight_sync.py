"""Weight sync into the rollout engine: seconds vs model bytes.

yatt-mm pushes (HF name, tensor) pairs into the running vLLM engine in place (`reload_weights`
RPC, then the encoder and prefix caches are dropped). Baselines in the same run: the same RPC
fed from a checkpoint file written to disk, and what a trainer without in-place sync does:
write an HF directory and start a new engine on it.

Last line: JSON with seconds and bytes (yatt-mm's in-place sync), plus the baselines.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import models  # noqa: F401


def main(rounds: int = 5) -> None:
    from safetensors.torch import load_file, save_file

    from models.tiny import tiny_model_dir
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine

    path = tiny_model_dir("policy")
    engine = RolloutEngine(EngineConfig(model=str(path)))
    weights = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    ours, disk = [], []
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "model.safetensors"
        for i in range(rounds):
            new = {k: v + 1e-3 * (i + 1) for k, v in weights.items()}
            ours.append(engine.update_weights(new.items())["seconds"])
            start = time.perf_counter()
            save_file(new, str(f))
            engine.update_weights(load_file(str(f)).items())  # same engine path, via the disk
            disk.append(time.perf_counter() - start)
        from models.hf_io import save_hf_dir

        start = time.perf_counter()
        fresh = RolloutEngine(EngineConfig(model=str(save_hf_dir(new, path, Path(tmp) / "hf"))))
        restart = time.perf_counter() - start
        fresh.shutdown()
    engine.update_weights(weights.items())
    s, d = statistics.median(ours), statistics.median(disk)
    print(f"in-place sync of {nbytes / 1e6:.2f} MB: {s * 1e3:.1f} ms ({nbytes / s / 1e9:.3f} GB/s); same RPC fed "
          f"through a checkpoint file: {d * 1e3:.1f} ms (medians of {rounds}); new engine on a saved HF "
          f"directory: {restart:.2f} s ({restart / s:.0f}x)")
    print(json.dumps({"seconds": round(s, 4), "bytes": nbytes, "gb_per_s": round(nbytes / s / 1e9, 4),
                      "via_disk_seconds": round(d, 4), "restart_engine_seconds": round(restart, 3)}))


if __name__ == "__main__":
    main()
