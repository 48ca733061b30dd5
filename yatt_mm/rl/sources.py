"""Where a controller's prompts come from.

`ParallelSource` (the design): every DP group reads its own samples from its own reader; no
process ever holds another group's media. `SingleControllerSource` (a baseline, for the
controller-memory benchmark only): rank 0 reads every group's samples and sends each rank its
share, media included, as verl's driver does. Its `take` is collective: every rank calls it the
same number of times with the same n.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from dataio.blend import BlendedReader
from dataio.reader import DataReader, Sample
from dataio.resplit import resplit
from yatt_mm.rl.balance import Move
from yatt_mm.rl.distributed import exchange
from yatt_mm.rl.samples import Prompt

Consumed = tuple[int, str, str]  # (epoch, key, blend source) of one sample read


def missing_text(sample: Sample) -> tuple[str, str] | None:
    """(reason, detail) when a sample lacks the question or the answer a rollout needs."""
    if not sample.prompt:
        return "no_question", "no prompt or question in its .json, and no .txt member"
    if sample.answer is None:
        return "no_answer", "no answer in its .json, and no .cls member"
    return None


def to_prompt(sample: Sample) -> Prompt | None:
    if missing_text(sample):
        return None
    # the draw by its place in the dataset, not by where the shards sit: a seeded run samples the
    # same from a copy of its data elsewhere, or in a bucket (a blend's sources count epochs apart)
    origin = f"{sample.epoch}/{sample.index}/{sample.key}"
    return Prompt(key=sample.key, question=sample.prompt, answer=str(sample.answer),
                  images=list(sample.images), videos=list(sample.videos), metadata=dict(sample.metadata),
                  origin=f"{sample.source}/{origin}" if sample.source else origin, source=sample.source)


class PromptSource:
    """What a controller draws its prompts from: `take(n)`, and what the data left out so far."""

    names: tuple[str, ...] | list[str] = ()  # a blend's sources (data.blend): the controller counts their groups apart

    def take(self, n: int) -> list[Prompt]:
        raise NotImplementedError

    def data_counts(self) -> dict[str, float]:
        """Samples left out so far (undecodable, over the token budget: the reader's skips; no
        question or answer), a blend's also by source: the same keys on every DP group."""
        names = ["skipped", "skipped_no_question", "remote_retries"] + [f"{n}/skipped" for n in self.names]
        return dict.fromkeys(names, 0.0)

    def resplit(self, states: list[dict], dp_rank: int, dp_size: int) -> dict:
        """This DP group's state, for a resume at another DP size, from every old group's
        `state_dict()` (dataio/resplit.py)."""
        raise ValueError(f"{type(self).__name__} resumes at the DP size its checkpoint was written at only")


class ParallelSource(PromptSource):
    def __init__(self, reader: DataReader | BlendedReader):
        self.reader = reader
        self._it: Iterator[Sample] = iter(reader)
        self.skipped_no_question = 0
        self.consumed: list[Consumed] = []  # since last drained: data lineage
        self.names = list(reader.names) if isinstance(reader, BlendedReader) else []  # a blend's sources

    def take(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            sample = next(self._it)
            self.consumed.append((sample.epoch, sample.key, sample.source))
            prompt = to_prompt(sample)
            if prompt is None:
                self.skipped_no_question += 1  # counted; reported in metrics (data_metrics)
                self.reader.quarantine(sample, *missing_text(sample))  # and named, as the reader's own skips
                continue
            out.append(prompt)
        return out

    def data_counts(self) -> dict[str, float]:
        counts = {"skipped": float(sum(self.reader.skips.values())),
                  "skipped_no_question": float(self.skipped_no_question),
                  # ranged reads of remote shards retried so far (0 for local shards)
                  "remote_retries": float(self.reader.remote_retries)}
        if isinstance(self.reader, BlendedReader):
            counts |= {f"{name}/skipped": float(n) for name, n in self.reader.skips_by_source().items()}
        return counts

    def drain_consumed(self) -> list[Consumed]:
        out, self.consumed = self.consumed, []
        return out

    def write_lineage(self, path: Path, step: int, consumed: list[Consumed] | None = None) -> None:
        """Append what this step consumed (drained now, or `consumed`, drained earlier), a JSON
        line per sample: the exactly-once record."""
        with open(path, "a") as f:
            for epoch, key, source in self.drain_consumed() if consumed is None else consumed:
                line = {"step": step, "epoch": epoch, "key": key} | ({"source": source} if source else {})
                f.write(json.dumps(line) + "\n")

    def state_dict(self) -> dict:
        return {"reader": self.reader.state_dict(), "skipped_no_question": self.skipped_no_question}

    def resplit(self, states: list[dict], dp_rank: int, dp_size: int) -> dict:
        """The rest of each unfinished epoch re-split over `dp_size` groups; old group d's
        counts go to group d % dp_size, so their sums stay."""
        return {"reader": resplit([s["reader"] for s in states], dp_rank, dp_size),
                "skipped_no_question": sum(int(s.get("skipped_no_question", 0)) for d, s in enumerate(states)
                                           if d % dp_size == dp_rank)}

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state["reader"])
        self.skipped_no_question = int(state.get("skipped_no_question", 0))  # counted so far, like the reader's skips
        self._it = iter(self.reader)


def pack_prompt(p: Prompt) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {f"image.{i}": torch.from_numpy(np.asarray(im).copy()) for i, im in enumerate(p.images)}
    tensors.update({f"video.{i}": torch.from_numpy(v) for i, v in enumerate(p.videos)})
    if not tensors:
        tensors["none"] = torch.zeros(1)
    meta = {"key": p.key, "question": p.question, "answer": p.answer, "metadata": json.dumps(p.metadata),
            "origin": p.origin, "source": p.source}
    return tensors, meta


def unpack_prompt(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Prompt:
    from PIL import Image

    images = [Image.fromarray(tensors[k].numpy()) for k in sorted(t for t in tensors if t.startswith("image."))]
    videos = [tensors[k].numpy() for k in sorted(t for t in tensors if t.startswith("video."))]
    return Prompt(meta["key"], meta["question"], meta["answer"], images, videos, json.loads(meta["metadata"]),
                  meta.get("origin", ""), meta.get("source", ""))  # checkpoints before origins: seeded by the key alone


class SingleControllerSource(PromptSource):
    def __init__(self, reader: DataReader | BlendedReader | None, rank: int, world: int, group,
                 names: list[str] = ()):
        self.rank, self.world, self.group = rank, world, group  # group: the leaders' CPU group
        self.inner = ParallelSource(reader) if rank == 0 else None  # rank 0 reads for everyone
        self.names = list(names)  # a blend's sources (data.blend)

    def take(self, n: int) -> list[Prompt]:
        held: dict[int, tuple] = {}
        moves: list[Move] = []
        mine: list[Prompt] = []
        if self.rank == 0:
            prompts = self.inner.take(n * self.world)
            mine = prompts[:n]
            for r in range(1, self.world):
                for j, p in enumerate(prompts[r * n : (r + 1) * n]):
                    held[r * n + j] = pack_prompt(p)
        moves = [Move(r * n + j, 0, r) for r in range(1, self.world) for j in range(n)]
        received = exchange(held, moves, self.rank, self.group)
        if self.rank != 0:
            mine = [unpack_prompt(*received[i]) for i in sorted(received)]
        dist.barrier(group=self.group)
        return mine

    def data_counts(self) -> dict[str, float]:
        return self.inner.data_counts() if self.inner else super().data_counts()  # rank 0 reads for all

    def drain_consumed(self) -> list[Consumed]:
        return self.inner.drain_consumed() if self.inner else []

    def write_lineage(self, path: Path, step: int, consumed: list[Consumed] | None = None) -> None:
        """Rank 0 drew every group's samples: its lineage file lists them all, the others none."""
        if self.inner:
            self.inner.write_lineage(path, step, consumed)

    def state_dict(self) -> dict:
        return self.inner.state_dict() if self.inner else {}

    def load_state_dict(self, state: dict) -> None:
        if self.inner:
            self.inner.load_state_dict(state)
