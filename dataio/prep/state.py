"""Resume state of a prep run, in OUT/.prep/:

- `run.json`: the options and a fingerprint of the sorted input list. A rerun with other
  options or inputs into the same OUT is refused (its shards would not fit together).
- `journal.jsonl`: one line appended (and fsynced) after each shard is renamed into place:
  the shard, where the next shard starts (item index, clip index), and the items finished
  since the previous line (count of good ones, the failures). The last line says `done`.

A rerun reads the journal, deletes what was in flight (a `*.tar.tmp`, or a shard renamed just
before the crash but not journaled), and continues at the last recorded position. Output is a
pure function of (inputs, options), so redone work reproduces the same bytes.

With --out in object storage the same files live in the staging folder and are uploaded after
each change (`dataio.prep.destination`); a rerun fetches them first."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from dataio.prep.destination import STATE_DIR, Destination
from dataio.prep.inputs import Item
VERSION = 1


def inputs_fingerprint(items: list[Item]) -> str:
    h = hashlib.sha1()
    for it in items:
        row = [it.path, it.caption, it.question, it.answer, list(it.extra)]
        if it.media or it.conversation or it.problem:  # dataset rows; other inputs keep their old fingerprint
            row += [list(it.media), it.conversation, it.problem]
        h.update(json.dumps(row).encode() + b"\n")
    return h.hexdigest()


@dataclass
class RunState:
    dest: Destination
    lines: list[dict] = field(default_factory=list)

    @property
    def dir(self) -> str:
        return os.path.join(self.dest.local, STATE_DIR)

    @property
    def journal(self) -> str:
        return os.path.join(self.dir, "journal.jsonl")

    @property
    def done(self) -> bool:
        return bool(self.lines) and bool(self.lines[-1].get("done"))

    @property
    def next_position(self) -> tuple[int, int]:
        return tuple(self.lines[-1]["next"]) if self.lines else (0, 0)

    @property
    def shards(self) -> list[str]:
        return [ln["shard"] for ln in self.lines if ln.get("shard")]

    @classmethod
    def open(cls, dest: Destination, options: dict, items: list[Item], overwrite: bool = False) -> "RunState":
        st = cls(dest)
        out = dest.shown()
        dest.fetch_state()
        os.makedirs(st.dir, exist_ok=True)
        run = {"version": VERSION, "options": options, "inputs": len(items), "inputs_sha1": inputs_fingerprint(items)}
        run_path = os.path.join(st.dir, "run.json")
        if os.path.exists(run_path) and not overwrite:
            with open(run_path) as f:
                old = json.load(f)
            if old != run:
                diff = sorted(k for k in set(old.get("options", {})) | set(options)
                              if old.get("options", {}).get(k) != options.get(k))
                what = f"options differ: {', '.join(diff)}" if diff else \
                    f"inputs differ ({old.get('inputs')} then, {len(items)} now, or their paths/text changed)"
                raise SystemExit(f"prep: {out} holds a run with other settings ({what}); rerun with the same "
                                 f"command to resume it, or give a new --out, or add --overwrite to start over")
            st.lines = st._read()
        else:
            if overwrite:
                st.clear()
            foreign = [n for n in dest.names() if n.startswith("shard-") or n == "index.parquet"]
            if foreign:
                raise SystemExit(f"prep: {out} already holds {foreign[0]} (and {len(foreign) - 1} more) not written "
                                 f"by a prep run; give an empty --out, or add --overwrite to replace them")
            tmp = run_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(run, f, indent=1, sort_keys=True)
            os.replace(tmp, run_path)
            open(st.journal, "w").close()
            dest.publish_state("run.json")
        st._drop_unjournaled()
        return st

    def _read(self) -> list[dict]:
        lines = []
        if os.path.exists(self.journal):
            with open(self.journal) as f:
                for raw in f:
                    try:
                        lines.append(json.loads(raw))
                    except json.JSONDecodeError:
                        break  # torn last line (killed while appending): that shard is redone
        return lines

    def _drop_unjournaled(self) -> None:
        """Shards from a crash between rename and journal append, and leftover temp files."""
        keep = set(self.shards)
        for name in self.dest.names():
            if name.startswith("shard-") and (name.endswith(".tmp") or name.endswith(".tar") and name not in keep):
                self.dest.remove(name)
        # rewrite the journal without a torn tail, so appends start on a clean line
        with open(self.journal, "w") as f:
            f.writelines(json.dumps(ln, sort_keys=True) + "\n" for ln in self.lines)
        self.dest.publish_state("journal.jsonl")

    def clear(self) -> None:
        for name in self.dest.names():
            if name.startswith("shard-") or name in ("index.parquet", "failures.parquet", "stats.json"):
                self.dest.remove(name)
        self.dest.clear_state()
        if os.path.exists(self.journal):
            os.unlink(self.journal)

    def append(self, line: dict) -> None:
        with open(self.journal, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.dest.publish_state("journal.jsonl")  # a URL --out: the line counts once it is uploaded
        self.lines.append(line)

    def next_shard_number(self) -> int:
        return len(self.shards)

    def failures(self) -> list[dict]:
        return [f for ln in self.lines for f in ln.get("failures", [])]

    def totals(self) -> dict:
        t = {"items_ok": 0, "samples": 0, "bytes": 0}
        for ln in self.lines:
            for k in t:
                t[k] += ln.get(k, 0)
        return t

