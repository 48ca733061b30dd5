"""`yatt-mm data ...`: index, inspect, keys, synth. Called from yatt_mm/cli.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds the `data` command group to the top-level parser's subparsers."""
    data = sub.add_parser("data", help="WebDataset shards: index, inspect, per-rank keys, synthetic data")
    dsub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)

    p = dsub.add_parser("index", help="build the parquet index of shards from tar headers (no decoding)")
    p.add_argument("shards", nargs="+", help="tar files, directories or globs; or s3://, gs://, http(s):// URLs")
    p.add_argument("--out", default=None, help="index file or URL (default: index.parquet in the shards' "
                   "directory or prefix)")
    p.set_defaults(func=cmd_index)

    p = dsub.add_parser("inspect", help="decode every sample as training would; summary and a contact sheet")
    p.add_argument("shards", nargs="+")
    p.add_argument("--index", default=None)
    p.add_argument("--sheet", default=None, help="contact-sheet PNG path (default: contact_sheet.png in the shards' "
                   "dir; for shards at URLs, in the current directory)")
    p.add_argument("--sheet-samples", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quarantine-log", default=None, help="JSONL of skipped samples (default: beside the sheet)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the counts")
    p.set_defaults(func=cmd_inspect)

    p = dsub.add_parser("keys", help="print the keys one DP rank reads in an epoch, in order")
    p.add_argument("shards", nargs="+")
    p.add_argument("--index", default=None)
    p.add_argument("--dp-rank", type=int, required=True)
    p.add_argument("--dp-size", type=int, required=True)
    p.add_argument("--workers", type=int, default=2,
                   help="decode workers; they do not change the rank's order (any free worker decodes the next key)")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slice-size", type=int, default=64)
    p.add_argument("--shuffle-buffer", type=int, default=256)
    p.add_argument("--no-shuffle", action="store_true")
    p.set_defaults(func=cmd_keys)

    p = dsub.add_parser("synth", help="write shards of generated images and videos with checkable answers")
    p.add_argument("out")
    p.add_argument("--images", type=int, default=100)
    p.add_argument("--videos", type=int, default=20)
    p.add_argument("--frame-sequences", type=int, default=0, help="videos stored as KEY.000.jpg ... instead of mp4")
    p.add_argument("--samples-per-shard", type=int, default=100)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--video-size", type=int, default=56)
    p.add_argument("--video-frames", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=None,
                   help="comma-separated tasks to draw, e.g. grounding (a box's coordinates, for the iou/giou "
                        "rewards) or colour,count; default: colour, count, direction (grounding only by name)")
    p.add_argument("--no-index", action="store_true", help="do not write index.parquet")
    p.set_defaults(func=cmd_synth)


def _default_dir(paths: list[str]) -> str:
    from dataio.storage import common_dir

    return common_dir(paths)


def cmd_index(args) -> int:
    from dataio.index import INDEX_NAME, build_index, expand_shards

    from dataio.storage import join, redact

    paths = expand_shards(args.shards)
    out = args.out or join(_default_dir(paths), INDEX_NAME)  # a URL beside remote shards
    t0 = time.time()
    table, _ = build_index(paths, out, progress=True)
    kinds = Counter(table.column("kind").to_pylist())
    samples = len(set(zip(table.column("shard").to_pylist(), table.column("key").to_pylist())))
    print(f"wrote {redact(out)}: {len(paths)} shards, {samples} samples, {table.num_rows} members "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) in {time.time() - t0:.2f}s")
    return 0


def cmd_keys(args) -> int:
    from dataio.reader import rank_keys

    if args.workers < 0:
        raise SystemExit(f"--workers must be >= 0, got {args.workers}")
    keys = rank_keys(args.shards, args.dp_rank, args.dp_size, seed=args.seed, epoch=args.epoch,
                     slice_size=args.slice_size, shuffle_buffer=args.shuffle_buffer, shuffle=not args.no_shuffle,
                     index=args.index)
    sys.stdout.write("".join(k + "\n" for k in keys))
    return 0


def contact_sheet(samples, path: str, tile: int = 160) -> None:
    """A grid of the first frame/image of each sample with its answer written under it."""
    from PIL import Image, ImageDraw

    cols = 4
    rows = max(1, (len(samples) + cols - 1) // cols)
    sheet = Image.new("RGB", (cols * tile, rows * (tile + 14)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for n, s in enumerate(samples):
        img = s.images[0] if s.images else Image.fromarray(s.videos[0][0])
        img = img.copy()
        img.thumbnail((tile, tile))
        x, y = (n % cols) * tile, (n // cols) * (tile + 14)
        sheet.paste(img, (x, y))
        kind = "image" if s.images else f"video x{len(s.videos[0])}"
        draw.text((x + 2, y + tile), f"{s.key} {kind}: {s.answer}"[:26], fill=(0, 0, 0))
    sheet.save(path)


def cmd_inspect(args) -> int:
    from dataio.index import expand_shards
    from dataio.reader import DataConfig, DataReader

    from dataio.storage import is_remote

    paths = expand_shards(args.shards) if not args.index else []
    base = _default_dir(paths) if paths else os.path.dirname(os.path.abspath(args.index))
    if is_remote(base) or (args.index and is_remote(args.index)):
        base = "."  # the sheet and the log are local files
    sheet = args.sheet or os.path.join(base, "contact_sheet.png")
    qlog = args.quarantine_log or os.path.splitext(sheet)[0] + ".quarantine.jsonl"
    if os.path.exists(qlog):
        os.unlink(qlog)
    cfg = DataConfig(shards=paths, index=args.index, shuffle=False, workers=args.workers, quarantine_log=qlog)
    reader = DataReader(cfg, 0, 1)
    total = len(reader.index)
    picked, decoded, t0 = [], 0, time.time()
    kinds = Counter()
    try:
        for s in reader.iter_epoch():
            decoded += 1
            kinds["image" if s.images else "video"] += 1
            if len(picked) < args.sheet_samples:
                picked.append(s)
            if reader.position % 500 == 0:
                print(f"inspect: {reader.position}/{total} samples, {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    finally:
        reader.close()
    skipped = sum(reader.skips.values())
    if picked:
        contact_sheet(picked, sheet)
    print(f"samples {total}, decoded {decoded} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
          f"skipped {skipped}" + (f" ({', '.join(f'{k} {v}' for k, v in sorted(reader.skips.items()))})" if skipped else "")
          + f", {time.time() - t0:.1f}s")
    if reader.ignored_members:
        print("ignored members (not decoded, never unpickled): "
              + ", ".join(f"{k} {v}" for k, v in sorted(reader.ignored_members.items())))
    print(f"contact sheet: {sheet if picked else '(none: nothing decoded)'}")
    if skipped:
        print(f"quarantine log: {qlog}")
    if args.json:
        print(json.dumps({"samples": total, "decoded": decoded, "skipped": skipped, "skipped_by_reason": dict(reader.skips),
                          "ignored_members": dict(reader.ignored_members),
                          "contact_sheet": sheet if picked else None, "quarantine_log": qlog if skipped else None}))
    return 0


def cmd_synth(args) -> int:
    from dataio.index import INDEX_NAME, build_index
    from dataio.synth import write_shards

    for name in ("images", "videos", "frame_sequences"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0")
    if args.samples_per_shard < 1:
        raise SystemExit("--samples-per-shard must be >= 1")
    t0 = time.time()
    try:
        paths = write_shards(args.out, args.images, args.videos, samples_per_shard=args.samples_per_shard,
                             seed=args.seed, image_size=args.image_size, video_size=args.video_size,
                             video_frames=args.video_frames, frame_sequences=args.frame_sequences, progress=True,
                             tasks=[t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None)
    except ValueError as e:  # an unknown task, or tasks that leave the asked-for videos without one
        raise SystemExit(f"yatt-mm data synth: {e}") from None
    print(f"wrote {len(paths)} shards to {args.out} "
          f"({args.images} images, {args.videos} videos, {args.frame_sequences} frame sequences) "
          f"in {time.time() - t0:.1f}s")
    if not args.no_index and paths:
        out = os.path.join(args.out, INDEX_NAME)
        build_index([os.path.abspath(p) for p in paths], out)
        print(f"wrote {out}")
    return 0
