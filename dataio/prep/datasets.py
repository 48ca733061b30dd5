"""Rows of dataset files people already have -> prep `Item`s, one per row.

Two shapes, told apart by extension and a quick look at the content (`--format` forces one):
- LLaVA-style JSON (a list) or JSONL: `{"id", "image": "a.jpg" | ["a.jpg", "b.jpg"], "video":
  "clip.mp4", "conversations": [{"from": "human", "value": "<image>\\nWhat is ...?"},
  {"from": "gpt", "value": "..."}, ...]}`;
- Hugging Face `datasets` parquet: an `image` column of struct {bytes, path} or an `images` list
  of them, the prompt in `problem` / `question` / `prompt` (a string, or a list of chat messages
  whose first user message counts), the answer in `answer` / `solution` /
  `reward_model.ground_truth`; other columns are kept in the sample's metadata.
Media paths are relative to the dataset file's folder, or to `--media-root` when given.

The prompt is the first human/user turn with its `<image>` / `<video>` placeholders taken out
(the media go before the text, in placeholder order); the answer is the last assistant turn; a
multi-turn conversation is kept whole in the metadata. A row that cannot become a sample (no
question, no media of the kind being prepared, placeholders that do not match its media) still
becomes an Item, carrying its `problem`, so it lands in failures.parquet with the reason.

Parquet is read one row group at a time (never the whole file);
image bytes are written once into OUT/.prep/media/ and then prepared like any image file.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

from dataio.prep.item import Item

PROMPT_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "solution")


def detect_format(path: str) -> str | None:
    """"llava", "hf-parquet", or None (not a dataset file: a plain list file or a media file)."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "hf-parquet"
    if lower.endswith(".json"):  # never media, and not a list file (.jsonl, .csv): a dataset, whose reading
        return "llava"           # names what is wrong with it (not JSON, not a list of rows)
    if lower.endswith(".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 16)
        return "llava" if '"conversations"' in head else None
    return None


def _row_item(source: str, row: int, prompt_turns: list[str], answer: str | None, images: list[str],
              videos: list[str], kind: str, extra: dict, conversation: list | None) -> Item:
    """The Item of one row, or of the reason it cannot be one."""
    path = f"{source}#{row:09d}"
    text = prompt_turns[0] if prompt_turns else None
    n_img = sum(t.count("<image>") for t in prompt_turns)
    n_vid = sum(t.count("<video>") for t in prompt_turns)
    media = images if kind == "images" else videos
    other = videos if kind == "images" else images
    problem = None
    if not text or not text.replace("<image>", "").replace("<video>", "").strip():
        problem = ("no_question", "no first human/user turn with text")
    elif not media:
        problem = ("no_media", f"no {'image' if kind == 'images' else 'video'} in this row"
                   + (f" (it has {len(other)} {'video' if kind == 'images' else 'image'}(s): "
                      f"prepare it with `yatt-mm prep {'video' if kind == 'images' else 'images'}`)" if other else ""))
    elif other:
        problem = ("mixed_media", f"{len(images)} image(s) and {len(videos)} video(s) in one row")
    elif kind == "video" and len(videos) > 1:
        problem = ("placeholder_mismatch", f"{len(videos)} videos in one row; one per sample")
    elif (n_img if kind == "images" else n_vid) not in (0, len(media)):
        tag = "<image>" if kind == "images" else "<video>"
        problem = ("placeholder_mismatch", f"{n_img if kind == 'images' else n_vid} {tag} placeholder(s) "
                                           f"for {len(media)} {'image' if kind == 'images' else 'video'}(s)")
    question = text.replace("<image>", "").replace("<video>", "").strip() if text else None
    plain = tuple(sorted((k, v if isinstance(v, (str, int, float, bool)) else json.dumps(v, sort_keys=True, default=str))
                         for k, v in extra.items() if v is not None))
    return Item(path, question=question or None, answer=None if answer is None else str(answer), extra=plain,
                media=tuple(media), conversation=json.dumps(conversation) if conversation else "", problem=problem)


def _media_path(base: str, rel: str) -> str:
    rel = os.path.expanduser(str(rel))
    return os.path.abspath(rel if os.path.isabs(rel) else os.path.join(base, rel))


# ---------------------------------------------------------------- LLaVA JSON / JSONL


def _llava_rows(path: str) -> Iterator[tuple[int, object]]:
    if path.lower().endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as e:
                        yield n, f"not JSON ({e})"
        return
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a LLaVA-style file holds a list of rows, not a {type(rows).__name__}")
    if rows and not any(isinstance(row, dict) and "conversations" in row for row in rows):
        raise ValueError(f"{path}: no row has \"conversations\": a .json input is a LLaVA-style dataset; a list of "
                         "media files goes in a .jsonl or .csv file with a 'path' column")
    yield from enumerate(rows)


def read_llava(path: str, kind: str, media_root: str = "") -> list[Item]:
    base = media_root or os.path.dirname(os.path.abspath(path))
    source = os.path.abspath(path)
    items = []
    for n, row in _llava_rows(path):
        if not isinstance(row, dict):
            items.append(Item(f"{source}#{n:09d}", problem=("bad_row", str(row)[:200] if isinstance(row, str)
                                                             else f"a {type(row).__name__}, not an object")))
            continue
        turns = row.get("conversations") or []
        human = [str(t.get("value", "")) for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")]
        gpt = [str(t.get("value", "")) for t in turns if isinstance(t, dict) and t.get("from") in ("gpt", "assistant")]
        images = row.get("image") or []
        images = [images] if isinstance(images, str) else list(images)
        videos = row.get("video") or []
        videos = [videos] if isinstance(videos, str) else list(videos)
        extra = {k: v for k, v in row.items() if k not in ("image", "video", "conversations")}
        items.append(_row_item(source, n, human, gpt[-1] if gpt else None, [_media_path(base, p) for p in images],
                               [_media_path(base, p) for p in videos], kind, extra,
                               turns if len(turns) > 2 else None))
    return items


# ---------------------------------------------------------------- Hugging Face parquet


def _first_user_text(prompt) -> str | None:
    """A prompt column: a string, or chat messages [{role, content}] (content a string or parts)."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    for msg in prompt:
        if isinstance(msg, dict) and msg.get("role", "user") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if isinstance(p, dict) and p.get("type") == "image":
                        parts.append("<image>")
                    elif isinstance(p, dict) and p.get("text") is not None:
                        parts.append(str(p["text"]))
                return "".join(parts)
            return None if content is None else str(content)
    return None


def _answer(row: dict):
    for c in ANSWER_COLUMNS:
        if row.get(c) is not None:
            return row[c]
    rm = row.get("reward_model")
    return rm.get("ground_truth") if isinstance(rm, dict) else None


def read_hf_parquet(path: str, kind: str, staging: str, media_root: str = "") -> list[Item]:
    """Rows of a `datasets` parquet file, read one row group at a time; the images' bytes go to
    files under `staging` (written once: a rerun finds them)."""
    import pyarrow.parquet as pq

    source = os.path.abspath(path)
    base = media_root or os.path.dirname(source)
    st = os.stat(source)  # a rewritten file gets a fresh folder, never stale bytes
    media_dir = os.path.join(staging, hashlib.sha1(f"{source}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12])
    os.makedirs(media_dir, exist_ok=True)
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    image_col = "images" if "images" in names else "image" if "image" in names else None
    items, n = [], 0
    # row group by row group: ParquetFile.iter_batches buffered a whole 512 MB file here (peak RSS
    # 690 MB), one row group at a time peaks at 160 MB
    for group in range(pf.num_row_groups):
        rows = pf.read_row_group(group).to_pylist()
        for row in rows:
            images = row.pop(image_col, None) if image_col else None
            images = [] if images is None else [images] if isinstance(images, dict) else list(images)
            files = []
            for i, im in enumerate(images):
                files.append(_stage_image(im, os.path.join(media_dir, f"{n:09d}_{i}"), base))
            prompt_col = next((c for c in PROMPT_COLUMNS if row.get(c) is not None), None)
            text = _first_user_text(row.get(prompt_col)) if prompt_col else None
            extra = {k: v for k, v in row.items() if k != prompt_col}
            names = [im.get("path") for im in images if isinstance(im, dict)]
            if any(names):  # the image column without its bytes
                extra[image_col] = names
            items.append(_row_item(source, n, [text] if text else [], _answer(row), files, [], kind, extra, None))
            n += 1
    return items


def _stage_image(image, stem: str, base: str) -> str:
    """A struct {bytes, path}: its bytes written to `stem` once (the file then stands for it),
    or, with no bytes, the path it names (relative to the parquet file's folder)."""
    if isinstance(image, dict) and image.get("bytes") is not None:
        data = image["bytes"]
        if not os.path.exists(stem) or os.path.getsize(stem) != len(data):
            tmp = f"{stem}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, stem)
        return stem
    if isinstance(image, dict) and image.get("path"):
        return _media_path(base, image["path"])
    return stem + ".missing"  # neither bytes nor a path: the row fails as unreadable
