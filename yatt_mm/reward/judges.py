"""Building a run's GenRM judges from config, and stopping them at the end.

How a judge runs is a plug-in chosen by `judge.backend`: `inprocess` (a vLLM engine in the
controller's process) and `server` (a vLLM OpenAI-compatible server process, which partial
colocation needs) are built in; `module:function` names anyone's own factory
`(JudgeConfig) -> judge`, where a judge has `score(items) -> list[JudgeScore]`, `stats`, and
optionally `engine` (memory the placement releases between phases) and `close()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yatt_mm.registry import Registry
from yatt_mm.reward.genrm import InProcessJudge, JudgeConfig, ServerJudge

JUDGES: Registry = Registry("judge backend")


@JUDGES.register("inprocess")
def in_process_judge(cfg: JudgeConfig) -> InProcessJudge:
    return InProcessJudge(cfg)


@JUDGES.register("server")
def served_judge(cfg: JudgeConfig) -> ServerJudge:
    from yatt_mm.engines.server import JudgeServer

    server = JudgeServer(cfg).start()
    return ServerJudge(cfg, server.base_url, server.model_name, server=server)


@dataclass
class WeightedJudge:
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the judge's model, prompt, votes and backend
    weight: float = 1.0  # its share of the total reward (>= 0, as a rule's: yatt_mm/reward/rewarder.py)

    RANGES = {"weight": ">= 0"}

    def validate(self) -> None:
        JUDGES.get(self.judge.backend)


@dataclass
class Judges:
    """A run's judges as (name, judge, weight), built once per rank."""

    entries: list[tuple[str, object, float]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]

    def engines(self) -> list:
        """In-process engines: what the placement releases and acquires as the 'judge' role."""
        return [j.engine for _, j, _ in self.entries if getattr(j, "engine", None) is not None]

    def close(self) -> None:
        for _, judge, _ in self.entries:
            if hasattr(judge, "close"):
                judge.close()


def build_judges(weighted: list[WeightedJudge], comm=None, engine_of=None) -> Judges:
    """Every rank calls it (in-process judges are vLLM engines, whose creation is collective).
    Inside a job (`comm`, models.comm.Comm), served judges are shared: one server a node (or a
    DP group, `judge.server_per`), started by the first controller there; the other controllers
    get its address, and TP peers (which never score) hold no judge for it. `engine_of(cfg)`:
    where an in-process judge generates, when not in an engine of its own (the disaggregated
    placement's engine worker, yatt_mm/engines/worker.py); there too only controllers hold one."""
    entries = []
    for w in weighted:
        if w.judge.backend == "inprocess" and engine_of is not None:
            if comm is not None and not comm.leader:
                continue
            judge = InProcessJudge(w.judge, engine=engine_of(w.judge))
        elif w.judge.backend == "server" and comm is not None:
            judge = shared_server_judge(w.judge, comm)
            if judge is None:
                continue
        else:
            judge = JUDGES.get(w.judge.backend)(w.judge)
        entries.append((w.judge.name, judge, w.weight))
    return Judges(entries)


def shared_server_judge(cfg: JudgeConfig, comm, start=served_judge, connect=None, what: str = ""):
    """This rank's client of the judge's server; the rank that should start it starts it. A
    collective over all ranks (their nodes and the servers' addresses cross on gloo). The same for
    any served model with a judge's server settings: `start(cfg)` starts its server and returns
    the starter's client (with `.server` and `.base_url`), `connect(base_url)` is another
    controller's client (default: a judge's)."""
    import os

    import torch
    import torch.distributed as dist

    places = torch.tensor([comm.node, int(comm.leader), os.getpid()])
    everyone = [torch.zeros(3, dtype=places.dtype) for _ in range(comm.world)]
    dist.all_gather(everyone, places, group=comm.world_cpu)
    places_of = [t.tolist() for t in everyone]
    leaders_here = [r for r, (node, leader, _) in enumerate(places_of) if leader and node == comm.node]
    starter = comm.rank if cfg.server_per == "dp_group" else min(leaders_here)
    judge = None
    if comm.leader and starter == comm.rank:
        judge = start(cfg)
        # the processes whose generation shares the node with this server (partial colocation
        # splits the node's cores between them and the server: yatt_mm/rl/split_runner.py)
        judge.node_pids = [pid for node, _, pid in places_of if node == comm.node]
        users = 1 if cfg.server_per == "dp_group" else len(leaders_here)
        print(f"{what or f'judge {cfg.name}'}: vLLM server at {judge.base_url} (node {comm.node}) for {users} controller(s)",
              flush=True)
    url = torch.zeros(256, dtype=torch.uint8)
    if judge is not None:
        raw = judge.base_url.encode()
        url[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    urls = [torch.zeros_like(url) for _ in range(comm.world)]
    dist.all_gather(urls, url, group=comm.world_cpu)
    if judge is not None or not comm.leader:
        return judge
    base_url = bytes(b for b in urls[starter].tolist() if b).decode()
    if connect is None:
        return ServerJudge(cfg, base_url, cfg.name)  # a client only: the starter owns (and stops) the server
    return connect(base_url)
