"""The Batch API's request body and response shapes (the response models document the
routes in the OpenAPI document; the routes return the same as dicts)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.batches.objects import Status
from gateway.http.openapi import error_responses

_SURROGATE = re.compile("[\ud800-\udfff]")


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(max_length=256)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)

    @model_validator(mode="after")
    def _storable(self) -> BatchCreate:
        texts = [self.input_file_id, self.endpoint, self.completion_window]
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
            texts += [key, value]
        if any(_SURROGATE.search(t) for t in texts):
            raise ValueError("text must be valid Unicode (this holds a lone surrogate)")
        return self


# Response shapes (for the OpenAPI document; the routes return the same as dicts).


class FileBody(BaseModel):
    """An OpenAI file object."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: str | None


class FileList(BaseModel):
    """``GET /v1/files``."""

    object: Literal["list"]
    data: list[FileBody]
    has_more: bool


class FileDeleted(BaseModel):
    """``DELETE /v1/files/{file_id}``."""

    id: str
    object: Literal["file"]
    deleted: bool


class BatchErrorItem(BaseModel):
    """Why a batch failed validation."""

    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    """``errors`` of a failed batch."""

    object: Literal["list"]
    data: list[BatchErrorItem]


class RequestCounts(BaseModel):
    """A batch's request counts."""

    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    """An OpenAI batch object."""

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    """``GET /v1/batches``."""

    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


FILE_UPLOAD_EXTRA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "The batch input: JSONL, one request per line (custom_id, method, "
        "url, body).",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}
FILE_CONTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's content (JSONL).",
        "content": {"application/jsonl": {"schema": {"type": "string"}}},
    },
    **error_responses(404),
}
