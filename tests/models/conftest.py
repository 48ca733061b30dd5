"""tests/dist/pipeline.py's runs that several test files compare against, each launched once a
session: a launch costs ~10 s of imports on two cores (~20 s with four ranks)."""

import sys
from pathlib import Path

import pytest

from subproc import run_json

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = str(ROOT / "tests" / "dist" / "pipeline.py")

# the slow tests' layouts (TP, PP, CP[, LoRA rank]; DP fills the rest), one launch per rank count:
# test_layouts.py's TP 2 x PP 2 (held to TP 2 alone too) and PP 2 x DP 2, and CP 2 alone (also with
# LoRA), PP 2 x CP 2, TP 2 x CP 2 and DP 2 x CP 2
TWO_RANK_LAYOUTS = [(2, 1, 1), (1, 1, 2), (1, 1, 2, 8)]
FOUR_RANK_LAYOUTS = [(2, 2, 1), (1, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 2)]


@pytest.fixture(scope="session")
def one_process_training(tmp_path_factory, tiny_policy):
    """tests/dist/pipeline.py in one process (TP 1, PP 1, DP 1): what every layout must equal."""
    out = tmp_path_factory.mktemp("pp-reference")
    run_json([sys.executable, PIPELINE, "--out", str(out)], timeout=900)
    return out


@pytest.fixture(scope="session")
def one_process_lora_training(tmp_path_factory, tiny_policy):
    """The same with LoRA (rank 8, B seeded; the reference is the base with the adapters off)."""
    out = tmp_path_factory.mktemp("lora-reference")
    run_json([sys.executable, PIPELINE, "--lora", "8", "--out", str(out)], timeout=900)
    return out


def _layouts(tmp_path_factory, nproc: int, layouts: list[tuple[int, ...]]) -> dict:
    """`layouts` in one launch of `nproc` ranks: {(tp, pp, cp[, lora]): the folder of that layout's results}."""
    out = tmp_path_factory.mktemp(f"layouts-{nproc}-ranks")
    run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), PIPELINE,
              "--layouts", *(",".join(map(str, layout)) for layout in layouts), "--out", str(out)], timeout=1200)
    return {layout: out / ",".join(map(str, layout)) for layout in layouts}


@pytest.fixture(scope="session")
def two_rank_layouts(tmp_path_factory, tiny_policy):
    return _layouts(tmp_path_factory, 2, TWO_RANK_LAYOUTS)


@pytest.fixture(scope="session")
def four_rank_layouts(tmp_path_factory, tiny_policy):
    return _layouts(tmp_path_factory, 4, FOUR_RANK_LAYOUTS)
