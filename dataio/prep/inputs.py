"""Inputs of a prep run: folders (recursive), globs, files, list files (.jsonl / .csv with a
`path` column and optional `caption`, `question` (or `prompt`) and `answer` columns), and dataset
files (LLaVA-style JSON/JSONL, Hugging Face parquet: `dataio/prep/datasets.py`) -> one sorted
list of `Item`s. Sorting makes the output independent of the order inputs were given in and of
directory listing order."""

from __future__ import annotations

import csv
import glob
import json
import os

from dataio.prep.datasets import detect_format, read_hf_parquet, read_llava
from dataio.prep.item import Item

VIDEO_SUFFIXES = {".mp4", ".webm", ".avi", ".mkv", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv", ".wmv", ".3gp"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
LIST_SUFFIXES = {".jsonl", ".csv"}
TEXT_FIELDS = ("caption", "question", "answer")


def _row_item(row: dict, base: str, where: str) -> Item:
    if "path" not in row or not str(row["path"]).strip():
        raise ValueError(f"{where}: a row has no 'path' column/value (list files need path, optional "
                         f"caption, question or prompt, answer)")
    path = os.path.expanduser(str(row["path"]).strip())
    if not os.path.isabs(path):
        path = os.path.join(base, path)  # relative to the list file, like a playlist
    q = row.get("question", row.get("prompt"))
    text = {"caption": row.get("caption"), "question": q, "answer": row.get("answer")}
    text = {k: (None if v is None or v == "" else str(v)) for k, v in text.items()}
    extra = tuple(sorted((k, v) for k, v in row.items()
                         if k not in ("path", "caption", "question", "prompt", "answer") and v not in (None, "")))
    return Item(os.path.abspath(path), extra=extra, **text)


def read_list_file(path: str) -> list[Item]:
    base = os.path.dirname(os.path.abspath(path))
    items = []
    if path.lower().endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
                if isinstance(row, str):
                    row = {"path": row}
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: each line must be an object with a 'path' key")
                items.append(_row_item(row, base, f"{path}:{n}"))
    else:
        with open(path, encoding="utf-8", newline="") as f:
            for n, row in enumerate(csv.DictReader(f), 2):
                items.append(_row_item(row, base, f"{path}:{n}"))
    return items


def sidecar_text(path: str) -> dict:
    """`clip.txt` beside `clip.mp4` is its caption; `clip.json` may hold caption/question/prompt/answer."""
    stem = os.path.splitext(path)[0]
    out: dict = {}
    if os.path.isfile(stem + ".txt"):
        with open(stem + ".txt", encoding="utf-8", errors="replace") as f:
            out["caption"] = f.read().strip() or None
    if os.path.isfile(stem + ".json"):
        try:
            with open(stem + ".json", encoding="utf-8") as f:
                obj = json.load(f)
            if isinstance(obj, dict):
                for k in TEXT_FIELDS:
                    if obj.get(k) not in (None, ""):
                        out[k] = str(obj[k])
                if "question" not in out and obj.get("prompt") not in (None, ""):
                    out["question"] = str(obj["prompt"])
        except (OSError, ValueError):
            pass  # an unreadable sidecar is not a reason to drop the media
    return out


def expand_inputs(specs: list[str], suffixes: set[str], kind: str = "images", staging: str = "",
                  fmt: str = "auto", media_root: str = "") -> list[Item]:
    """Folders (recursive, files with `suffixes`), globs, single files, list files and dataset
    files -> Items sorted by path, de-duplicated (the first mention of a path keeps its text).
    `fmt` forces how .json/.jsonl/.parquet inputs are read (auto: by a look at them); `staging`
    is where a parquet file's image bytes are written; `media_root` is what a dataset file's
    relative media paths start from (default: the file's folder)."""
    items: list[Item] = []
    for spec in specs:
        spec = os.path.expanduser(str(spec))
        dataset = (fmt if fmt != "auto" else detect_format(spec)) if os.path.isfile(spec) else None
        if dataset == "llava":
            items += read_llava(spec, kind, media_root)
        elif dataset == "hf-parquet":
            items += read_hf_parquet(spec, kind, staging or os.path.join(os.path.dirname(os.path.abspath(spec)),
                                                                         ".prep-media"), media_root)
        elif os.path.isdir(spec):
            found = [os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs
                     if os.path.splitext(f)[1].lower() in suffixes]
            items += [Item(os.path.abspath(p), **sidecar_text(p)) for p in found]
        elif os.path.splitext(spec)[1].lower() in LIST_SUFFIXES and os.path.isfile(spec):
            items += read_list_file(spec)
        elif any(c in spec for c in "*?["):
            found = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
            items += [Item(os.path.abspath(p), **sidecar_text(p)) for p in found]
        elif os.path.exists(spec):
            items.append(Item(os.path.abspath(spec), **sidecar_text(spec)))
        else:
            raise FileNotFoundError(f"prep: input {spec!r} does not exist (give folders, globs, files, "
                                    f"a .jsonl/.csv list with a 'path' column, LLaVA JSON or HF parquet)")
    seen: dict[str, Item] = {}
    for it in items:
        seen.setdefault(it.path, it)
    return [seen[p] for p in sorted(seen)]
