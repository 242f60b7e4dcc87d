"""The Batch API's objects as stored and shown: a file, a batch and its statuses.

OpenAI's shapes: :meth:`FileObject.body` and :meth:`BatchState.body` are what the routes
return. Only ``/v1/chat/completions`` lines in a ``24h`` window are accepted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

ENDPOINT: Final = "/v1/chat/completions"
TEXT_ENDPOINT: Final = "/v1/completions"
ENDPOINTS: Final = (ENDPOINT, TEXT_ENDPOINT)
COMPLETION_WINDOW: Final = "24h"
WINDOW_S: Final = 24 * 3600
FINAL_STATUSES: Final = ("failed", "completed", "expired", "cancelled")
Status = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip
_TIMESTAMPS = (
    "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at",
)  # fmt: skip


def new_file_id() -> str:
    """A fresh file id, OpenAI style."""
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    """A fresh batch id, OpenAI style."""
    return f"batch_{uuid.uuid4().hex[:24]}"


def as_text(value: Any) -> str:
    """A Redis reply (bytes or not) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class FileObject:
    """A stored file's metadata."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def body(self) -> dict[str, Any]:
        """The OpenAI file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": None,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass(slots=True)
class BatchState:
    """A batch as stored: what the API shows and what the runner needs."""

    id: str
    tenant: str
    status: str
    input_file_id: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    timestamps: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    endpoint: str = ENDPOINT

    @classmethod
    def from_hash(cls, tenant: str, raw: Mapping[Any, Any]) -> BatchState:
        """Decode the stored hash."""
        fields = {as_text(k): as_text(v) for k, v in raw.items()}
        static = json.loads(fields["static"])
        return cls(
            id=static["id"],
            tenant=tenant,
            status=fields.get("status", "validating"),
            input_file_id=static["input_file_id"],
            created_at=int(static["created_at"]),
            expires_at=int(fields.get("expires_at", static["expires_at"])),
            metadata=static.get("metadata"),
            endpoint=static.get("endpoint", ENDPOINT),
            total=int(fields.get("total", 0)),
            completed=int(fields.get("completed", 0)),
            failed=int(fields.get("failed", 0)),
            timestamps={k: int(fields[k]) for k in _TIMESTAMPS if fields.get(k)},
            output_file_id=fields.get("output_file_id") or None,
            error_file_id=fields.get("error_file_id") or None,
            errors=json.loads(fields["errors"]) if fields.get("errors") else None,
        )

    def body(self) -> dict[str, Any]:
        """The OpenAI batch object."""
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": COMPLETION_WINDOW,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            **{k: self.timestamps.get(k) for k in _TIMESTAMPS},
            "expires_at": self.expires_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }
