"""A second ``charserve up`` on one machine is refused at once, before it starts anything,
and a Redis that cannot start says why (cluster/ops/stack.py,
cluster/runtime/redis_server.py).

Before, a second stack reported ready (the first one's gateway answered its ``/ready``),
both embedded Redis servers wrote one append-only file and corrupted it, and the next start
failed with "redis-server exited with 1" and nothing more."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


def _holders(folder: Path) -> list[str]:
    """The processes with the folder's lock file open (for a failure's message)."""
    path = str(folder / LOCK_NAME)
    found = []
    for process in psutil.process_iter(["pid", "name", "status"]):
        try:
            if any(f.path == path for f in process.open_files()):
                found.append(f"{process.pid} {process.info['name']} {process.info['status']}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _exited(pid: int) -> bool:
    """Gone, or a zombie (its files are closed; its new parent may never reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_lock_lives_as_long_as_the_stack_or_its_redis(tmp_path: Path) -> None:
    # A stack killed with SIGKILL runs no cleanup, and its Redis (a session of its own)
    # keeps writing the folder: the Redis holds the lock until it stops too.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from cluster.ops.stack import data_dir_lock\n"
            "from cluster.runtime.redis_server import RedisServer\n"
            "with data_dir_lock(sys.argv[1]) as fd:\n"
            "    redis = RedisServer(data_dir=sys.argv[1], hold_fds=(fd,)).start()\n"
            "    print('redis', redis.pid, flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    redis_pid = 0
    try:
        assert holder.stdout is not None
        line = ""
        while not line.startswith("redis "):  # after the log lines
            line = holder.stdout.readline()
            assert line, "the holder exited"
        redis_pid = int(line.split()[1])
        with pytest.raises(StackConflict) as refused:
            with data_dir_lock(str(tmp_path)):
                pass
        assert f"pid {holder.pid}" in str(refused.value)
        holder.kill()
        holder.wait()
        with pytest.raises(StackConflict):  # its Redis still runs, and holds the folder
            with data_dir_lock(str(tmp_path)):
                pass
    finally:
        holder.kill()
        holder.wait()
        if redis_pid:
            os.kill(redis_pid, signal.SIGKILL)
    # Neither runs: the folder is free (once any child Redis forked, such as an
    # append-only file rewrite, which shares its files, has ended too).
    deadline = time.monotonic() + 30
    while True:
        try:
            with data_dir_lock(str(tmp_path)):
                assert _exited(redis_pid)
                assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
            break
        except StackConflict:
            assert time.monotonic() < deadline, f"the folder stayed held by {_holders(tmp_path)}"
            time.sleep(0.1)


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
