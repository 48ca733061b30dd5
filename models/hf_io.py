"""Write a trained model as a Hugging Face directory that transformers and vLLM load."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Everything of the source directory except its weights: config, tokenizer, processors, template.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".index.json")


def check_hf_dir(path: str | Path) -> Path:
    """`path` if it holds an HF model (config.json), else an error that says what to give."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF model directory (no config.json); give one, or tiny:policy "
                                "for the built-in tiny model (built by the yatt-mm launcher)")
    return Path(path)


def save_hf_dir(tensors: dict[str, torch.Tensor], source_dir: str | Path, out_dir: str | Path,
                extra_files: dict[str, str] | None = None) -> Path:
    """Weights from `tensors`, everything else from `source_dir` (but its tiny-model stamp: this
    is another model now) plus `extra_files` (name -> text); written to a temporary sibling and
    renamed into place, so a crash never leaves a directory that looks complete."""
    from safetensors.torch import save_file

    with dir_in_place(out_dir) as tmp:
        for f in Path(source_dir).iterdir():
            if f.is_file() and not f.name.endswith(_NOT_COPIED) and f.name != "yatt_tiny.json":
                shutil.copy2(f, tmp / f.name)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    return Path(out_dir)


@contextmanager
def dir_in_place(out_dir: str | Path) -> Iterator[Path]:
    """A directory the body fills in a temporary sibling, renamed to `out_dir` (replacing one
    there) when the body returns: a crash never leaves a directory that looks complete."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_pretrained_on_any_rank(model, out_dir: str | Path) -> Path:
    """`model.save_pretrained(out_dir)` (a transformers model) from whichever process calls it.

    transformers 5 writes nothing, silently, from a process whose torch.distributed rank is not
    0 once a process group exists: a rank > 0 building a cached tiny model inside torchrun left a
    directory without weights or config, which the other ranks then read (or rebuilt under it).
    The files checked afterwards turn any other way of writing nothing into an error here."""
    out = Path(out_dir)
    model.should_save_on_this_rank = lambda is_main_process: True  # the caller decided to write
    model.save_pretrained(out, safe_serialization=True)
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not (out / "config.json").is_file() or not any((out / f).is_file() for f in weights):
        raise RuntimeError(f"transformers' save_pretrained wrote no config.json or weights in {out}")
    return out
