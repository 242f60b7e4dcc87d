"""A two-node Ray cluster on one machine, started the way an operator starts one.

The head node runs ``ray start --head`` and the second node ``ray start --address`` with
resources of its own. Each node gets its own ``--temp-dir`` and free ports (Ray's fixed
defaults, such as the dashboard agent's 52365, would clash with the other node and with
any other Ray on the machine), and a token of its own for Ray's token authentication, so
nothing here touches ``~/.ray`` or another Ray instance. Both nodes announce
127.0.0.1, so nothing listens for or connects to another address. A node is stopped by
killing the processes it started, by pid: ``ray stop`` would stop every Ray on the machine.

Ray gives a starting raylet a fixed 30 s to register with the GCS and then gives up. On a
loaded two-core machine that can happen, so a node that fails to start is started again
from scratch (new temp dir, new ports), and a node that never starts fails the tests with
its raylet's and GCS's own logs, not only ``ray start``'s.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from cluster.runtime.net import free_port

RAY = str(Path(sys.executable).with_name("ray"))
# What ``ray start`` prints once its node is up (head or not).
STARTED = "Ray runtime started."
START_TIMEOUT_S = 120.0
START_ATTEMPTS = 3


class NodeStartError(RuntimeError):
    """A node's ``ray start`` exited or timed out before its node came up."""


class RayNode:
    """One ``ray start --block`` process and everything it spawns."""

    def __init__(self, name: str, env: dict[str, str], num_cpus: int) -> None:
        self.name = name
        self._env = env
        self._num_cpus = num_cpus
        # Short: Ray's Unix socket paths live under it (108 bytes at most).
        self.temp_dir = tempfile.mkdtemp(prefix=f"cs{name[-1]}", dir="/tmp")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(self.temp_dir, "ray-start.log")

    def start(self, *, head_port: int | None = None, address: str | None = None) -> None:
        """Start as the head (``head_port``) or join the head at ``address``."""
        args = [
            RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            f"--num-cpus={self._num_cpus}",
            f"--resources={json.dumps({self.name: 1})}",
            f"--temp-dir={self.temp_dir}",
            "--node-ip-address=127.0.0.1",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        if head_port is not None:
            args += [
                "--head",
                f"--port={head_port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
            ]
        else:
            args.append(f"--address={address}")
        with self._log.open("wb") as out:
            self._proc = subprocess.Popen(args, env=self._env, stdout=out, stderr=out)

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until ``ray start`` reports the node up; raise :class:`NodeStartError`
        (with the node's logs) if it exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if STARTED in self._read(self._log):
                return
            if not self.alive:
                raise NodeStartError(f"ray start for {self.name} exited:\n{self.logs()}")
            time.sleep(0.2)
        raise NodeStartError(f"{self.name} not up after {timeout_s:.0f} s:\n{self.logs()}")

    def pids(self) -> set[int]:
        """The pids of this node's processes now (raylet, workers, replicas, ...): what
        ``ray start`` spawned, and what names this node's temp dir (the GCS and raylet of
        a ``ray start`` that failed and left them behind) with what those spawned."""
        if self._proc is None:
            return set()
        roots = [self._proc.pid]
        for proc in psutil.process_iter(["cmdline"]):
            if any(self.temp_dir in arg for arg in proc.info["cmdline"] or ()):
                roots.append(proc.pid)
        found: set[int] = set()
        for pid in roots:
            try:
                root = psutil.Process(pid)
                found |= {root.pid} | {p.pid for p in root.children(recursive=True)}
            except psutil.NoSuchProcess:
                continue
        return found

    @property
    def alive(self) -> bool:
        """True while ``ray start`` runs."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of this node at once (the node fails, it is not
        drained) and wait until they are gone."""
        procs = []
        for pid in self.pids():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        if self._proc is not None:
            self._proc.wait(timeout=10)

    def logs(self, lines: int = 30) -> str:
        """The ends of ``ray start``'s output and of the raylet's and GCS's logs (for
        failure messages)."""
        logs_dir = Path(self.temp_dir, "session_latest", "logs")
        files = {"ray start": self._log} | {
            name: logs_dir / name
            for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")
        }
        parts = []
        for title, path in files.items():
            text = self._read(path)
            if text:
                parts.append(f"--- {title} ---\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def remove(self) -> None:
        """Kill what is left and delete the temp dir."""
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class LocalRayCluster:
    """A head node (resource ``node_a``) and a second node (``node_b``)."""

    def __init__(self, num_cpus: int = 2) -> None:
        self._num_cpus = num_cpus
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray's token authentication, with a token of this cluster's own.
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
        }
        self.env.pop("RAY_ADDRESS", None)
        self.head = RayNode("node_a", self.env, num_cpus)
        self.second = RayNode("node_b", self.env, num_cpus)

    def start(self) -> None:
        """Start the head, then the second node, each up before going on."""
        self.head = self._start_node(self.head, head=True)
        self.second = self._start_node(self.second, head=False)

    def _start_node(self, node: RayNode, *, head: bool) -> RayNode:
        """Start ``node`` and wait for it; one that fails to start is replaced by a fresh
        node (new temp dir; for the head, a new port too), up to ``START_ATTEMPTS`` times."""
        attempt = 1
        while True:
            try:
                if head:
                    node.start(head_port=self.port)
                else:
                    node.start(address=self.address)
                node.wait_started()
                return node
            except NodeStartError:
                node.remove()
                if attempt == START_ATTEMPTS:
                    raise
            attempt += 1
            if head:
                self.port = free_port()
                self.address = f"127.0.0.1:{self.port}"
            node = RayNode(node.name, self.env, self._num_cpus)

    def node_of(self, pid: int) -> str | None:
        """Which node a process belongs to."""
        for node in (self.head, self.second):
            if pid in node.pids():
                return node.name
        return None

    def stop(self) -> None:
        """Kill every process of both nodes; remove their files."""
        self.second.remove()
        self.head.remove()
