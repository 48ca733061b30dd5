"""Where a run listens. A run on one machine opens its listening sockets on loopback only, so
nothing on the network can reach its rendezvous, its process groups or (unless `judge.host` says
otherwise, with an API key) its judge servers; a run on several machines listens where the other
machines can reach it (see docs/gpu-and-multinode.md for each port).

torch's TCPStore listens on every interface whatever host name it is given, unless it is handed a
socket already bound (`master_listen_fd`): the one-node launch does that for torchrun's
rendezvous store (which the ranks' default process group shares) through a rendezvous backend of
its own, `python -m yatt_mm.loopback TORCHRUN-ARGS` (torchrun, with that backend registered
through torchrun's public registry), and the engine worker for its weights store. gloo and NCCL
listen on the interface `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` name: the launcher sets both
to the loopback interface for a one-node run, unless the user's environment sets them.

Standard library only at import: the config check (`check_served_host`) runs before any rank
starts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import uuid

HOST = "127.0.0.1"
BACKEND = "yatt-mm-loopback"  # the rendezvous backend's name, as torchrun's --rdzv-backend takes it


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host`: `localhost` or a loopback address. Any other
    name counts as reachable from elsewhere (what a name resolves to can change)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


KEY_ENV = "YATT_MM_JUDGE_API_KEY"  # where a judge server's API key is read from by default


def check_served_host(name: str, host: str, key_env: str, role: str = "judge",
                      setting: str = "judge.api_key_env") -> None:
    """A server on `host` that other machines can reach must require an API key, read from the
    environment variable `key_env`: refused otherwise, with what to set."""
    if not is_loopback(host) and not (key_env and os.environ.get(key_env)):
        raise ValueError(
            f"{role} '{name}': host {host} is not a loopback address, so other machines can reach its vLLM server: "
            f"put an API key in the environment variable {key_env or KEY_ENV} ({setting} names the "
            "variable; every node's environment needs it), or serve on 127.0.0.1")


def loopback_interface() -> str:
    """The name of the interface that carries 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    try:
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == HOST for a in addresses):
                return name
    except ImportError:
        pass
    return "lo"


def one_node_env(environ: dict[str, str]) -> dict[str, str]:
    """What a one-node run's ranks get so that their process groups listen on loopback: gloo's
    and NCCL's interface, where `environ` does not name one already."""
    lo = loopback_interface()
    return {key: environ.get(key, lo) for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def listening_socket(host: str = HOST, port: int = 0) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) and listening, for a server that takes one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


def port_taken_by(host: str, port: int) -> str | None:
    """None when a server could listen on (`host`, `port`) now; else who listens there, as far
    as this user may see ("pid N: COMMAND", or "another process")."""
    try:
        listening_socket(host, port).close()
        return None
    except OSError:
        pass
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return f"pid {c.pid}: {' '.join(psutil.Process(c.pid).cmdline())[:200]}"
    except Exception:  # psutil missing, or not allowed to look: the port is taken all the same
        pass
    return "another process"


def loopback_store(port: int = 0, world_size: int | None = None, timeout_s: float = 600.0, **kwargs):
    """A TCPStore server that listens on 127.0.0.1 only."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = listening_socket(HOST, port)
    port = sock.getsockname()[1]
    # the store owns the descriptor from here on (it closes it)
    return dist.TCPStore(HOST, port, world_size, True, timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
                         **kwargs)


def _rendezvous_handler(params):
    """torchrun's rendezvous for a job of one node: this agent alone, its store on loopback; the
    ranks connect to it as their default group's store (torchrun's agent-store sharing)."""
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class LoopbackRendezvous(RendezvousHandler):
        def __init__(self) -> None:
            self.store = loopback_store(timeout_s=float(params.config.get("timeout", 600)), multi_tenant=True)
            self.closed = False

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            store_info = RendezvousStoreInfo(HOST, self.store.port)  # what the ranks' default group connects to
            return RendezvousInfo(PrefixStore(params.run_id, self.store), 0, 1, store_info)

        def is_closed(self) -> bool:
            return self.closed

        def set_closed(self) -> None:
            self.closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return params.run_id

        def shutdown(self) -> bool:
            return True

    return LoopbackRendezvous()


def torchrun_args() -> list[str]:
    """The rendezvous options of a one-node launch through this module's `main`."""
    return ["--nnodes", "1", "--rdzv-backend", BACKEND, "--rdzv-endpoint", f"{HOST}:0", "--rdzv-id", uuid.uuid4().hex]


def main(argv: list[str]) -> None:
    """torchrun with this module's rendezvous backend registered (`python -m yatt_mm.loopback
    ARGS`: ARGS as torchrun takes them, with `torchrun_args()`)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    rendezvous_handler_registry.register(BACKEND, _rendezvous_handler)
    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
