"""Free ports for the servers the stack and the tests start (cluster/runtime/net.py)."""

from __future__ import annotations

import socket

import pytest

from cluster.runtime import net


def test_a_free_port_is_outside_the_kernels_ephemeral_range() -> None:
    # Outgoing connections and bind-to-0 servers (Ray's) take ports from that range, and
    # one took a test gateway's port between the pick and the gateway's bind.
    low = net._ephemeral_low()
    for _ in range(20):
        port = net.free_port()
        assert net.FIXED_PORTS_FROM <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_ephemeral_low", lambda: net.FIXED_PORTS_FROM)
    assert net.free_port() >= 1024


def test_ports_picked_together_are_distinct() -> None:
    ports = net.free_ports(12)
    assert len(set(ports)) == 12
    assert all(net.FIXED_PORTS_FROM <= port < net._ephemeral_low() for port in ports)
