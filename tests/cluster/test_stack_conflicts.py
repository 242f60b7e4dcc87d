"""A second ``charserve up`` on one machine is refused at once, before it starts anything,
and a Redis that cannot start says why (cluster/ops/stack.py,
cluster/runtime/redis_server.py).

Before, a second stack reported ready (the first one's gateway answered its ``/ready``),
both embedded Redis servers wrote one append-only file and corrupted it, and the next start
failed with "redis-server exited with 1" and nothing more."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from cluster.ops.stack import LOCK_NAME, LocalStack, StackConflict, data_dir_lock, url_file
from cluster.runtime.net import check_port_free, free_port
from cluster.runtime.redis_server import RedisServer
from cluster.runtime.settings import Settings


def test_one_data_folder_holds_one_stack(tmp_path: Path) -> None:
    with data_dir_lock(str(tmp_path)):
        with pytest.raises(StackConflict) as refused:
            with data_dir_lock(str(tmp_path)):
                pass
    assert str(tmp_path) in str(refused.value) and "CHARSERVE_DATA_DIR" in str(refused.value)
    with data_dir_lock(str(tmp_path)):  # released with its holder
        pass


def test_a_dead_holder_holds_nothing(tmp_path: Path) -> None:
    # A stack killed with SIGKILL never runs its cleanup: the kernel drops its lock.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from cluster.ops.stack import data_dir_lock\n"
            "with data_dir_lock(sys.argv[1]):\n"
            "    print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StackConflict) as refused:
            with data_dir_lock(str(tmp_path)):
                pass
        assert f"pid {holder.pid}" in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    with data_dir_lock(str(tmp_path)) as path:
        assert path == tmp_path / LOCK_NAME


def test_a_port_in_use_is_named() -> None:
    port = free_port()
    check_port_free("127.0.0.1", port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(OSError, match=f"127.0.0.1:{port} is in use"):
            check_port_free("127.0.0.1", port)


def test_a_second_stack_is_refused_before_it_starts_anything(tmp_path: Path) -> None:
    with socket.socket() as listener:  # the first stack's gateway, as far as this one sees
        port = free_port()
        listener.bind(("127.0.0.1", port))
        listener.listen()
        settings = Settings(data_dir=str(tmp_path), port=port, redis_url=None)
        with pytest.raises(StackConflict, match="CHARSERVE_PORT"):
            LocalStack(settings).start()
    assert not url_file(settings).exists()  # no Redis was started
    with data_dir_lock(str(tmp_path)):  # and the refused stack let go of the folder
        pass


def test_a_redis_that_cannot_start_says_why(tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path).start()
    client = redis.Redis.from_url(server.url)
    try:
        for i in range(100):
            client.set(f"k{i}", "v" * 100)
    finally:
        client.close()
        server.stop_process()
    aof = next((tmp_path / "appendonlydir").glob("*.incr.aof"))
    data = aof.read_bytes()
    aof.write_bytes(data[: len(data) // 2] + b"not a command\r\n" + data[len(data) // 2 :])
    with pytest.raises(RuntimeError) as failed:
        server.start()
    message = str(failed.value)
    assert "append only file" in message and "redis-check-aof" in message
    assert str(tmp_path / "redis.log") in message
    assert server.pid is None  # nothing left running
