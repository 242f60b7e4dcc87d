"""Log lines: one JSON format for charserve's loggers and the standard library's, and a
log call that never fails its caller (cluster/runtime/logs.py). Each case runs in a
process of its own: logging is configured once per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SETUP = """
import io, logging, sys, structlog
from cluster.runtime.logs import configure_logging
configure_logging("info", "json")
log = structlog.get_logger("charserve.test")
"""


def run(body: str) -> list[dict[str, object]]:
    """Run ``body`` after SETUP in a fresh interpreter; its stderr's lines, parsed."""
    done = subprocess.run(
        [sys.executable, "-c", SETUP + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in done.stderr.splitlines()]


def test_own_and_standard_library_lines_share_one_format() -> None:
    lines = run(
        """
        structlog.contextvars.bind_contextvars(request_id="r1", tenant="t1")
        log.info("request finished", ttft_ms=12.5, stream=True, user=None)
        logging.getLogger("uvicorn.error").warning("from %s", "uvicorn")
        log.debug("not at info")
        """
    )
    assert len(lines) == 2, lines
    own, foreign = lines
    assert own["event"] == "request finished" and own["level"] == "info"
    assert own["logger"] == "charserve.test"
    assert (own["request_id"], own["tenant"]) == ("r1", "t1")
    assert (own["ttft_ms"], own["stream"], own["user"]) == (12.5, True, None)
    assert str(own["timestamp"]).endswith("Z")
    assert foreign["event"] == "from uvicorn" and foreign["level"] == "warning"
    assert foreign["logger"] == "uvicorn.error" and foreign["request_id"] == "r1"
    assert set(own) - {"ttft_ms", "stream", "user"} == set(foreign)


def test_exception_carries_its_traceback() -> None:
    (line,) = run(
        """
        try:
            raise KeyError("missing")
        except KeyError:
            log.exception("job failed")
        """
    )
    assert line["level"] == "error"
    assert "KeyError: 'missing'" in str(line["exception"])


def test_values_json_has_no_form_for_do_not_fail_the_call() -> None:
    lines = run(
        """
        class Odd:
            def __repr__(self) -> str:
                return "<odd>"
        log.info("odd value", value=Odd(), data={("a", 1): 2})
        log.info("text", text="é\\u2028")
        """
    )
    odd, text = lines
    assert odd["value"] == "<odd>" and odd["data"] == {"('a', 1)": 2}
    assert text["text"] == "é\u2028"


def test_lines_follow_a_swapped_stderr_and_a_closed_one_is_not_an_error() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SETUP
            + textwrap.dedent(
                """
                swapped = io.StringIO()
                sys.stderr = swapped
                log.info("to the swapped stream")
                closed = io.StringIO()
                closed.close()
                sys.stderr = closed
                log.warning("dropped, not raised")
                sys.stdout.write(swapped.getvalue())
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = done.stdout.splitlines()
    assert json.loads(line)["event"] == "to the swapped stream"


def test_a_forked_child_logs_while_a_parent_thread_held_the_writer() -> None:
    """vLLM forks its engine core from the replica: a child must not inherit a held lock."""
    (line,) = run(
        """
        import os, signal
        from cluster.runtime import logs
        with logs._write_lock:  # as another thread of the parent writing at the fork
            pid = os.fork()
            if pid == 0:
                signal.alarm(20)  # a child that hangs ends itself
                log.info("from the child")
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        """
    )
    assert line["event"] == "from the child"
