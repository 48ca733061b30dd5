"""A prep run's unit of work: one media file, or one row of a dataset file. Its own module because
both ways inputs arrive (`inputs.py`: files, folders, list files; `datasets.py`: LLaVA JSON and
HF parquet rows) make Items, and the rest of prep (work, state, runner) only reads them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Item:
    path: str  # absolute: the media file, or FILE#ROW for a row of a dataset file
    caption: str | None = None
    question: str | None = None
    answer: str | None = None
    extra: tuple = field(default_factory=tuple)  # other list-file columns, as sorted (name, value) pairs
    media: tuple[str, ...] = ()  # a dataset row's media files, in prompt order (empty: `path` is the media)
    conversation: str = ""  # a dataset row's multi-turn conversation, as JSON, kept in the metadata
    problem: tuple[str, str] | None = None  # (reason, detail) when the row cannot become a sample

    @property
    def files(self) -> tuple[str, ...]:
        return self.media or (self.path,)
