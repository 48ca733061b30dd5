"""Shared by the benchmarks: the smoke-run switch and what each benchmark's last line promises,
and realistic test media written to tar shards (the dataio benchmarks)."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

ROOT = Path(__file__).resolve().parents[1]

# -- smoke runs -------------------------------------------------------------------------------
# BENCH_SMOKE=1 runs a benchmark at its smallest size: the same code path end to end (real
# models, engines and launches), with the fewest steps, rounds and samples and no repeated
# rounds, so that a test can run every benchmark and read its last line in minutes. An
# environment variable rather than a flag: the benchmarks' own child processes (torchrun ranks,
# spawned workers, `--child` re-runs of the script) inherit it without passing it on.
SMOKE = os.environ.get("BENCH_SMOKE", "0") not in ("", "0")


def full_or_smoke(full, smoke):
    """`full` when measuring, `smoke` in a smoke run."""
    return smoke if SMOKE else full


def output_root() -> Path:
    """Where a benchmark keeps what later steps read (run directories, a measured profile, a
    figure): `runs/` (git-ignored) when measuring; in a smoke run $BENCH_SMOKE_DIR, or
    yatt-mm-bench-smoke in the temporary directory, so that a smoke run never replaces a
    measurement's output."""
    if not SMOKE:
        return ROOT / "runs"
    return Path(os.environ.get("BENCH_SMOKE_DIR") or Path(tempfile.gettempdir()) / "yatt-mm-bench-smoke")


def shown(path: Path) -> str:
    """A path for a result line: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class LastLine:
    """What a benchmark's last line, one JSON object, promises (the keys its docstring names and
    docs/benchmarks.md quotes); tests/benchmarks/test_benchmark_smoke.py checks it on a smoke run."""

    numbers: tuple[str, ...]  # keys whose values are finite numbers
    others: tuple[str, ...] = ()  # keys present with a value of any kind (text, flags, lists, tables, null)
    # module -> keys that are finite numbers where that optional module is installed, null where not
    numbers_if_installed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    after: str | None = None  # the benchmark whose smoke output this one reads: run that first


def photo_like_jpeg(rng: np.random.Generator, size: int = 512, quality: int = 90) -> bytes:
    """A 512x512 JPEG of roughly photo-like entropy (about 60-90 KB): smooth gradients, shapes,
    blur and sensor-like noise."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    base = np.stack([np.sin(x * rng.uniform(2, 9) + rng.uniform(0, 6)), np.cos(y * rng.uniform(2, 9)),
                     np.sin((x + y) * rng.uniform(2, 9))], -1) * 70 + 128
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = rng.integers(0, size, 2)
        d.ellipse([x0, y0, x0 + rng.integers(20, 160), y0 + rng.integers(20, 160)],
                  fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    img = img.filter(ImageFilter.GaussianBlur(1.5))
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, 9, (size, size, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_shards(root: str, samples: list[tuple[str, str, bytes]], per_shard: int) -> list[str]:
    """samples: (key, ext, bytes) -> shards of `per_shard` samples, each with a small KEY.json."""
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        p = os.path.join(root, f"shard-{s // per_shard:05d}.tar")
        with tarfile.open(p, "w") as tf:
            for key, ext, data in samples[s:s + per_shard]:
                for name, blob in ((f"{key}.{ext}", data), (f"{key}.json", b'{"prompt": "q", "answer": "a"}')):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        paths.append(p)
    return paths


# Every benchmark (benchmarks/*.py not starting with "_") has its entry here: a new benchmark
# without one fails the smoke test, so none is added without a smoke run that reads its last line.
LAST_LINES: dict[str, LastLine] = {
    "bench_async.py": LastLine(
        numbers=("step_time_ratio", "target", "sync_step_seconds", "async_step_seconds", "eval_reward_sync",
                 "eval_reward_async", "eval_reward_diff", "cpu_busy_sync", "cpu_busy_async", "step_time_ratio_bound",
                 "core_seconds_ratio", "predicted_step_time_ratio", "staleness_mean", "stale_dropped", "rounds",
                 "steps", "load_average_end"),
        # eval_reward_sync_stdev: null after one round
        others=("met", "round_ratios", "eval_reward_sync_stdev", "eval_rewards", "overlap_slowdown",
                "predicted_round_ratios", "predicted_bound", "runs_kept")),
    "bench_checkpoint.py": LastLine(numbers=("snapshot_ms", "write_s", "bytes", "snapshot_ms_before", "write_s_before",
                                             "bytes_before", "sync_over_async")),
    "bench_lora.py": LastLine(numbers=("sync_bytes_ratio", "checkpoint_bytes_ratio", "train_peak_ratio",
                                       "step_time_ratio", "sync_export_s_ratio", "lora_rank"),
                              others=("full", "lora")),
    "bench_controller_memory.py": LastLine(numbers=("parallel_rss_ratio", "single_rss_ratio"),
                                           others=("parallel_peak_mib", "single_peak_mib")),
    "bench_dp_balance.py": LastLine(numbers=("imbalance_before", "imbalance_after", "imbalance_text_only",
                                             "groups_moved", "groups", "plan_ms")),
    "bench_genrm.py": LastLine(numbers=("inprocess_per_s", "server_per_s", "server_startup_s")),
    "bench_image_pipeline.py": LastLine(
        numbers=("images", "image_kb", "workers", "rounds", "img_per_s", "limit_img_per_s", "webdataset_img_per_s",
                 "ratio_to_limit", "ratio_to_webdataset", "median_round_ratio_to_limit",
                 "median_round_ratio_to_webdataset", "img_per_cpu_s", "limit_img_per_cpu_s",
                 "webdataset_img_per_cpu_s", "cpu_ratio_to_limit", "draft_img_per_s", "draft_limit_img_per_s",
                 "draft_ratio_to_draft_limit", "draft_median_round_ratio", "draft_cpu_ratio_to_draft_limit",
                 "draft_ratio_to_full_limit"),
        others=("source", "target", "draft_target", "load_avg_start_end")),
    "bench_long_context.py": LastLine(
        numbers=("tokens", "video_tokens", "frames", "rounds", "cp_max_logprob_diff", "max_abs_logprob",
                 "activation_mib_cp1", "activation_mib_cp2", "activation_ratio_cp2", "vision_activation_mib_cp1",
                 "vision_activation_mib_cp2", "vision_share_of_activations_cp2", "activation_ratio_cp2_vision_whole",
                 "step_s_cp1", "step_s_cp2", "tokens_per_s_cp1", "tokens_per_s_cp2", "throughput_ratio_cp2",
                 "sequence_speedup_cp2", "activation_mib_cp2_a2a", "activation_ratio_cp2_a2a", "step_s_cp2_a2a",
                 "throughput_ratio_cp2_a2a"),
        others=("model",)),
    "bench_memory_plan.py": LastLine(numbers=("max_rel_err", "max_step_rel_err", "activation_calibration"),
                                     others=("configs", "within_15pct", "params_exact")),
    "bench_packing.py": LastLine(numbers=("samples", "real_tokens", "micro_batch_tokens", "padded_micro_batches",
                                          "packed_micro_batches", "padded_real_tokens_per_micro_batch",
                                          "packed_real_tokens_per_micro_batch", "padded_pad_share", "padded_seconds",
                                          "packed_seconds", "speedup")),
    "bench_parquet_prep.py": LastLine(numbers=("file_mb", "prep_peak_rss_mb", "read_table_peak_rss_mb",
                                               "prep_rss_over_file", "samples", "prep_seconds")),
    "bench_placement.py": LastLine(
        numbers=("rollout_reward_seconds_full", "rollout_reward_seconds_partial", "ratio", "overlap", "steps_each",
                 "response_length_mean", "load_average_end"),
        others=("full_by_rollout_threads", "uncontended", "judge_share_median", "runs_kept", "simulator")),
    "bench_reader_memory.py": LastLine(numbers=("shards_1x", "samples_1x", "samples_10x", "peak_rss_mb_1x",
                                                "peak_rss_mb_10x", "rss_ratio_10x_to_1x")),
    # Megatron-Energon is an optional dependency (pip install -e '.[bench]'): without it, or where its
    # loader fails on the shards, its figures are null and energon_note says why
    "bench_remote_pipeline.py": LastLine(
        numbers=("images", "image_kb", "rounds", "latency_ms", "local_img_per_s", "remote_img_per_s", "remote_vs_local",
                 "target", "remote_unmerged_vs_local", "requests_per_sample", "requests_per_sample_100k",
                 "local_cpu_ms", "remote_cpu_ms", "server_cpu_ms", "proxy_cpu_ms", "remote_vs_local_reader_cpu"),
        others=("met", "energon_note", "energon_img_per_s", "vs_energon")),
    "bench_rl_step.py": LastLine(numbers=("step_s", "idle_share"), others=("phases_s",)),
    # TRL is an optional dependency (pip install -e '.[bench]'); without it a smoke run times
    # yatt-mm's side alone and reports TRL's figures as null (a measurement refuses to start)
    "bench_rl_vs_trl.py": LastLine(numbers=("yatt_s_per_step",), others=("rows", "setting", "tiny"),
                                   numbers_if_installed={"trl": ("trl_s_per_step", "ratio")}),
    "bench_rollout.py": LastLine(numbers=("overhead", "seeded_overhead", "tokens_per_s", "seeded_tokens_per_s",
                                          "raw_vllm_tokens_per_s")),
    "bench_train_step.py": LastLine(
        numbers=("tokens_per_s", "transformers_tokens_per_s", "ratio_to_transformers", "median_round_ratio",
                 "median_tokens_per_s", "median_transformers_tokens_per_s", "first_step_loss_gap", "tokens_per_step",
                 "batch", "micro_batch", "rounds", "steps_per_round", "threads"),
        others=("kind", "statistic")),
    "bench_video_pipeline.py": LastLine(
        numbers=("clips", "frames_per_clip", "workers", "rounds", "clips_per_s", "decord_clips_per_s",
                 "ratio_to_decord", "median_round_ratio_to_decord", "inline_clips_per_s", "inline_ratio_to_decord",
                 "inline_median_round_ratio_to_decord", "clips_per_cpu_s", "decord_clips_per_cpu_s",
                 "inline_clips_per_cpu_s", "cpu_ratio_to_decord", "first_sample_s_with_child_start"),
        others=("clip", "load_avg_start_end")),
    "bench_video_prep.py": LastLine(numbers=("clips", "videos", "clips_per_s_1w", "clips_per_s_2w",
                                             "decode_only_clips_per_s", "ratio_2w_to_decode_only", "load_avg_1m"),
                                    others=("time_share_1w", "shards_identical_1w_2w")),
    "bench_vision_tower.py": LastLine(
        numbers=("patches", "frames", "side", "fwd_bwd_s", "masked_fwd_bwd_s", "transformers_fwd_bwd_s",
                 "speedup_vs_masked", "speedup_vs_transformers", "saved_mib", "masked_saved_mib",
                 "transformers_saved_mib", "saved_ratio_vs_masked", "max_abs_diff_vs_transformers",
                 "max_abs_diff_vs_masked", "rounds"),
        others=("statistic",)),
    "bench_weight_sync.py": LastLine(numbers=("seconds", "bytes", "gb_per_s", "via_disk_seconds",
                                              "restart_engine_seconds", "peak_extra_bytes_one_bucket",
                                              "peak_extra_bytes_bucketed", "model_bytes", "buckets", "bucket_mb",
                                              "extra_ratio_bucketed", "extra_ratio_one_bucket")),
    # reads the runs bench_placement keeps (its smoke runs, in a smoke run)
    "validate_simulator.py": LastLine(
        numbers=("measured_full", "predicted_full_from_partial", "error_full", "measured_partial",
                 "predicted_partial_from_full", "error_partial", "judge_cores", "measured_ratio", "predicted_ratio"),
        others=("within_15pct", "steps", "profile", "figure", "uncontended_steps_only"),
        after="bench_placement.py"),
}
