"""Shared by the distributed tests (CPU gloo and GPU NCCL): a free TCP port on this host for
a process group's rendezvous (`tcp://127.0.0.1:<port>`, `--master-port`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket holds now (the OS picks it; the group binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
