"""A batch's lines: its input file parsed into requests (or the reasons it cannot run),
and the output and error lines of OpenAI's batch format, stored one per input line and
assembled in input order when the batch ends.

Output lines: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}``. Error-file lines have the same shape, plus ``"line"`` (1-based line
number in the input file): an API error is the ``response`` with its status and OpenAI
error body; a line that could not run has ``"response": null, "error": {"code",
"message"}``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.batches.objects import ENDPOINT
from gateway.http.errors import APIError


@dataclass(frozen=True, slots=True)
class InputLine:
    """One request line of a batch's input: runnable, or an error with its reason."""

    index: int
    line_no: int
    custom_id: str | None
    body: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None


@dataclass(slots=True)
class ParsedInput:
    """A parsed input file: its lines, or why the whole file is refused."""

    lines: list[InputLine] = field(default_factory=list)
    fatal: list[dict[str, Any]] = field(default_factory=list)


def _fatal(code: str, message: str, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def parse_input(data: bytes, max_lines: int, endpoint: str = ENDPOINT) -> ParsedInput:
    """Parse a batch input file (JSONL of ``custom_id``, ``method``, ``url``, ``body``)."""
    parsed = ParsedInput()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        parsed.fatal.append(_fatal("invalid_file", f"the file is not UTF-8 text: {exc}"))
        return parsed
    seen: dict[str, int] = {}
    # Split on newlines only: JSON strings may hold U+2028 and friends.
    for line_no, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        index = len(parsed.lines)
        if index >= max_lines:
            parsed.fatal.append(
                _fatal("too_many_requests", f"a batch holds at most {max_lines} requests")
            )
            return parsed
        parsed.lines.append(_parse_line(index, line_no, raw, endpoint))
        custom_id = parsed.lines[-1].custom_id
        if custom_id is not None:
            if custom_id in seen:
                parsed.fatal.append(
                    _fatal(
                        "duplicate_custom_id",
                        f"custom_id {custom_id!r} on line {line_no} was already used on "
                        f"line {seen[custom_id]}; each request needs a unique custom_id",
                        line_no,
                    )
                )
            else:
                seen[custom_id] = line_no
    if not parsed.lines:
        parsed.fatal.append(_fatal("empty_file", "the input file has no requests"))
    return parsed


def _parse_line(index: int, line_no: int, raw: str, endpoint: str) -> InputLine:
    def bad(code: str, message: str, custom_id: str | None = None) -> InputLine:
        return InputLine(index, line_no, custom_id, None, code, message)

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return bad("invalid_json_line", f"line {line_no} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return bad("invalid_json_line", f"line {line_no} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", f"line {line_no} has no custom_id (a non-empty string)")
    if obj.get("method") != "POST":
        return bad("invalid_method", f"line {line_no}: method must be POST", custom_id)
    if obj.get("url") != endpoint:
        return bad(
            "invalid_url",
            f"line {line_no}: url must be {endpoint}, the batch's endpoint, not {obj.get('url')!r}",
            custom_id,
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", f"line {line_no}: body must be a JSON object", custom_id)
    return InputLine(index, line_no, custom_id, body)


def _request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"


def _result(
    kind: bytes, line: InputLine, response: dict[str, Any] | None, error: dict[str, str] | None
) -> bytes:
    """A stored result: ``kind`` (``o`` output, ``e`` error) + the file's JSON line. Error
    lines also carry their input line number."""
    record: dict[str, Any] = {"id": _request_id(), "custom_id": line.custom_id}
    if kind == b"e":
        record["line"] = line.line_no
    record["response"] = response
    record["error"] = error
    return kind + json.dumps(record, separators=(",", ":")).encode()


def output_line(line: InputLine, request_id: str, body: dict[str, Any]) -> bytes:
    """A stored result for a successful request."""
    return _result(b"o", line, {"status_code": 200, "request_id": request_id, "body": body}, None)


def api_error_line(line: InputLine, request_id: str, exc: APIError) -> bytes:
    """A stored result for a request the API refused."""
    response = {"status_code": exc.status, "request_id": request_id, "body": exc.body()}
    return _result(b"e", line, response, None)


def error_line(line: InputLine, code: str, message: str) -> bytes:
    """A stored result for a line that could not run."""
    return _result(b"e", line, None, {"code": code, "message": message})


def assemble_files(results: dict[int, bytes]) -> tuple[bytes, bytes]:
    """The output and error files (JSONL, in input order) from the stored results."""
    out: list[bytes] = []
    err: list[bytes] = []
    for index in sorted(results):
        value = results[index]
        (out if value[:1] == b"o" else err).append(value[1:] + b"\n")
    return b"".join(out), b"".join(err)
