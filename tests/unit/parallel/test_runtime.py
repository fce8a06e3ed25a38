from __future__ import annotations

import socket
from pathlib import Path

from trainbook.parallel import runtime
from trainbook.parallel.runtime import EPHEMERAL_RANGE, free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """The port a later server binds must not be one the kernel hands to outgoing connections
    meanwhile: it comes from outside the ephemeral range, and it is free when handed out."""
    low, high = (int(x) for x in Path(EPHEMERAL_RANGE).read_text().split())
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high and 1024 <= port <= 65535, (port, low, high)
        with socket.socket() as s:
            s.bind(("localhost", port))


def test_free_port_falls_back_to_the_kernels_pick_when_no_other_range_is_left(monkeypatch, tmp_path):
    whole = tmp_path / "ip_local_port_range"
    whole.write_text("1025\t65535\n")  # every unprivileged port is ephemeral
    monkeypatch.setattr(runtime, "EPHEMERAL_RANGE", str(whole))
    port = free_port()
    assert 1025 <= port <= 65535
    with socket.socket() as s:
        s.bind(("localhost", port))
