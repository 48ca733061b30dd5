"""Shared, expensive fixtures: built once per test session. The tests mirror the package
layout (tests/dataio, tests/models, ...); the helpers they share (dataio_helpers.py,
prep_media.py, subproc.py, and the torchrun workers in dist/) stay here, importable from every
folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import models  # noqa: F401 - installs the CPU runtime hooks before any test imports torchvision


@pytest.fixture(scope="session")
def tiny_policy():
    from models.tiny import tiny_model_dir

    return tiny_model_dir("policy", seed=0)


@pytest.fixture(scope="session")
def rollout_engine(tiny_policy):
    """One in-process vLLM engine for the whole session (about 3-5 s to start on CPU)."""
    from yatt_mm.engines.engine import EngineConfig, RolloutEngine

    return RolloutEngine(EngineConfig(model=str(tiny_policy)))


@pytest.fixture(scope="session")
def warm_policy(tmp_path_factory):
    """The tiny policy after its short SFT warm start (about 15 s once, then cached): its groups
    get different rewards, so RL tests have real advantages, gradients and weight changes."""
    from dataio.synth import write_shards
    from yatt_mm.demo.warmstart import warm_start

    data = tmp_path_factory.mktemp("warm-data") / "train"
    write_shards(str(data), images=64, videos=0, samples_per_shard=16, seed=6, tasks=["colour"])
    return warm_start("policy", data, quiet=True)
