"""`yatt-mm prep video|images INPUT... --out DIR`. Called from yatt_mm/cli.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _size(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().rstrip("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256MB, 1G, 5000000)") from None


def _common(p: argparse.ArgumentParser, kind: str) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="folders (recursive), globs, files, .jsonl/.csv lists with path and optional "
                        "caption, question (or prompt), answer columns, LLaVA-style .json/.jsonl, or "
                        "Hugging Face datasets .parquet")
    p.add_argument("--format", choices=["auto", "llava", "hf-parquet"], default="auto",
                   help="how .json/.jsonl/.parquet inputs are read (auto: by extension and a look at the content)")
    p.add_argument("--media-root", default="", help="folder that a dataset file's relative media paths start from "
                                                     "(default: the dataset file's folder)")
    p.add_argument("--out", required=True, help="output directory, or an s3:// or gs:// prefix: shards, index.parquet, "
                   "failures.parquet, stats.json")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="worker processes (0: in this process)")
    p.add_argument("--engine", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    p.add_argument("--max-side", type=int, default=448, help="long side at most this (aspect kept, never enlarged; 0: off)")
    p.add_argument("--max-pixels", type=int, default=0, help="width x height at most this (0: off)")
    p.add_argument("--jpeg-quality", type=int, default=90)
    p.add_argument("--shard-size", type=_size, default="256MB", help="target shard size (e.g. 256MB)")
    p.add_argument("--max-samples-per-shard", type=int, default=10000)
    p.add_argument("--caption-prompt", default=f"Describe the {'video' if kind == 'video' else 'image'}.",
                   help="prompt of items that have a caption but no question (the caption becomes the answer)")
    p.add_argument("--overwrite", action="store_true", help="discard what OUT holds and start over")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="end with the stats as one JSON line")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    prep = sub.add_parser("prep", help="turn raw videos or images into training shards")
    psub = prep.add_subparsers(dest="prep_command", metavar="PREP_COMMAND", required=True)

    p = psub.add_parser("video", help="videos -> clips -> sampled frames (or mp4 clips) in WebDataset shards")
    _common(p, "video")
    p.add_argument("--clips", choices=["stride", "scenes"], default="stride", help="fixed stride, or cut at scene changes")
    p.add_argument("--max-clip-len", type=float, default=10.0, help="seconds; longer spans are cut")
    p.add_argument("--min-clip-len", type=float, default=1.0, help="seconds; shorter clips are dropped")
    p.add_argument("--stride", type=float, default=None, help="seconds between clip starts (default: --max-clip-len)")
    p.add_argument("--scene-threshold", type=float, default=30.0,
                   help="mean absolute difference (0-255) of consecutive tiny gray frames that counts as a cut")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (at most the source rate)")
    p.add_argument("--max-frames", type=int, default=32, help="frames per clip at most (thinned uniformly)")
    p.add_argument("--store", choices=["frames", "mp4"], default="frames",
                   help="frames: KEY.000.jpg ...; mp4: the sampled frames re-encoded as one KEY.mp4")
    p.add_argument("--crf", type=int, default=23, help="x264 quality of --store mp4")
    p.add_argument("--decode-threads", type=int, default=1, help="decoder threads per worker")
    p.set_defaults(func=cmd_prep, prep_kind="video")

    p = psub.add_parser("images", help="images with prompts and answers -> WebDataset shards")
    _common(p, "images")
    p.set_defaults(func=cmd_prep, prep_kind="images")


def cmd_prep(args) -> int:
    from dataio.prep.runner import run_prep
    from dataio.prep.work import PrepOptions
    from dataio.storage import RemoteReadError, join, redact

    kw = dict(kind=args.prep_kind, max_side=args.max_side or None, max_pixels=args.max_pixels or None,
              jpeg_quality=args.jpeg_quality, shard_size=args.shard_size,
              max_samples_per_shard=args.max_samples_per_shard, caption_prompt=args.caption_prompt)
    if args.prep_kind == "video":
        kw.update(clips=args.clips, max_clip_len=args.max_clip_len, min_clip_len=args.min_clip_len,
                  stride=args.stride, scene_threshold=args.scene_threshold, fps=args.fps,
                  max_frames=args.max_frames, store=args.store, crf=args.crf, decode_threads=args.decode_threads)
    opts = PrepOptions(**kw)
    t0 = time.time()
    try:
        stats = run_prep(args.inputs, args.out, opts, workers=args.workers, engine=args.engine,
                         progress=not args.no_progress, overwrite=args.overwrite, ray_address=args.ray_address,
                         input_format=args.format, media_root=args.media_root)
    except (ValueError, PermissionError, RemoteReadError) as e:  # bad options; a URL --out: 403, unreachable
        raise SystemExit(f"prep {args.prep_kind}: {e}") from None
    except KeyboardInterrupt:
        print("\nprep: interrupted; finished shards are kept. Rerun the same command to resume.", file=sys.stderr)
        return 130
    unit = "clips" if args.prep_kind == "video" else "images"
    what = "videos" if args.prep_kind == "video" else "images"
    reasons = ", ".join(f"{k} {v}" for k, v in stats["failures_by_reason"].items())
    print(f"{what}: {stats['items_ok']} ok, {stats['items_failed']} failed{f' ({reasons})' if reasons else ''}; "
          f"{stats['samples']} {unit} in {stats['shards']} shards ({stats['bytes'] / 2**20:.1f} MiB) "
          f"in {time.time() - t0:.1f}s{' (resumed)' if stats['resumed'] else ''} -> {redact(args.out)}")
    if stats["items_failed"]:
        print(f"failures: {redact(join(args.out, 'failures.parquet'))}")
    if args.json:
        print(json.dumps(stats, sort_keys=True))
    return 0
