"""The OpenAI Batch API's routes: ``/v1/files`` and ``/v1/batches``.

- ``POST /v1/files`` (multipart ``file`` + ``purpose=batch``), ``GET /v1/files``,
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.
- ``POST /v1/batches`` (``input_file_id``, ``endpoint`` = ``/v1/chat/completions``,
  ``completion_window`` = ``24h``, ``metadata``), ``GET /v1/batches/{id}``,
  ``GET /v1/batches`` (newest first, ``after`` and ``limit``),
  ``POST /v1/batches/{id}/cancel``.

Files and batches belong to the tenant of the API key: another tenant's id is a 404.
Lines run through the same queue as live chat, in the ``batch`` class, so they never take
the slots reserved for interactive work (see :mod:`gateway.batches.runner`); state is in
Redis (:mod:`gateway.batches.store`), so a batch survives a gateway restart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from cluster.runtime.settings import Settings
from cluster.wire.retry import retry_headers
from gateway.batches.objects import COMPLETION_WINDOW, ENDPOINTS
from gateway.batches.schemas import (
    FILE_CONTENT_RESPONSES,
    FILE_UPLOAD_EXTRA,
    Batch,
    BatchCreate,
    BatchList,
    FileBody,
    FileDeleted,
    FileList,
)
from gateway.batches.store import BatchStore
from gateway.http.context import tenant as tenant_of
from gateway.http.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
from gateway.http.openapi import error_responses, ok
from gateway.services import services

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class BatchConflict(Conflict):
    """The batch is in a state that does not allow this (409)."""

    code = "invalid_batch_state"


@contextmanager
def _store_errors() -> Iterator[None]:
    """Redis down: 503 with Retry-After, like the rest of the gateway."""
    try:
        yield
    except RedisError as exc:
        raise ServiceUnavailable(
            "the batch store is unavailable", headers=retry_headers(1000)
        ) from exc


def _safe_filename(name: str) -> str:
    return name.encode("utf-8", "ignore").decode("utf-8")[:255] or "upload.jsonl"


def _store(request: Request) -> BatchStore:
    return services(request).batch_store


def _valid_id(value: str) -> bool:
    return bool(_ID.match(value))


def _file_not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id", code="file_not_found")


def _batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


def _settings(request: Request) -> Settings:
    return services(request).settings


def router() -> APIRouter:
    """The ``/v1/files`` and ``/v1/batches`` routes (their knobs: ``CHARSERVE_BATCH_*``)."""
    api = APIRouter()

    @api.post(
        "/v1/files",
        responses={**ok(FileBody, "The stored file."), **error_responses(400)},
        openapi_extra=FILE_UPLOAD_EXTRA,
    )
    async def upload_file(request: Request) -> dict[str, Any]:
        """Upload a batch input file (multipart: ``file`` and ``purpose=batch``)."""
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BadRequest("send the file as multipart/form-data with 'file' and 'purpose'")
        async with request.form(max_files=1, max_fields=8) as form:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                shown = purpose if isinstance(purpose, str) else "a file"
                raise BadRequest(
                    f"purpose must be 'batch' (the only one this server has), not {shown!r}",
                    param="purpose",
                )
            if upload is None or isinstance(upload, str):
                raise BadRequest("send the file as a form file named 'file'", param="file")
            bound = _settings(request).batch_max_file_bytes
            data = await upload.read(bound + 1)
            filename = _safe_filename(upload.filename or "")
        if len(data) > bound:
            raise PayloadTooLarge(f"the file is over {bound} bytes")
        with _store_errors():
            tenant = tenant_of(request)
            limits = await services(request).auth.limits(tenant)
            file = await _store(request).put_file(
                tenant,
                filename,
                "batch",
                data,
                max_files=limits.max_files,
                max_bytes=limits.max_file_bytes,
            )
        return file.body()

    @api.get(
        "/v1/files",
        responses={**ok(FileList, "The tenant's files, newest first."), **error_responses(400)},
    )
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
    ) -> dict[str, Any]:
        """The tenant's files, newest first."""
        with _store_errors():
            files = await _store(request).files(tenant_of(request))
        data = [f.body() for f in files if purpose is None or f.purpose == purpose][:limit]
        return {"object": "list", "data": data, "has_more": False}

    @api.get(
        "/v1/files/{file_id}",
        responses={**ok(FileBody, "The file."), **error_responses(404)},
    )
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        """One file's metadata."""
        file = None
        if _valid_id(file_id):
            with _store_errors():
                file = await _store(request).file(tenant_of(request), file_id)
        if file is None:
            raise _file_not_found(file_id)
        return file.body()

    @api.get(
        "/v1/files/{file_id}/content",
        response_model=None,
        response_class=Response,
        responses=FILE_CONTENT_RESPONSES,
    )
    async def file_content(file_id: str, request: Request) -> Response:
        """A file's content: an uploaded input, or a batch's output or error file."""
        data = None
        if _valid_id(file_id):
            with _store_errors():
                data = await _store(request).file_content(tenant_of(request), file_id)
        if data is None:
            raise _file_not_found(file_id)
        return Response(data, media_type="application/jsonl")

    @api.delete(
        "/v1/files/{file_id}",
        responses={**ok(FileDeleted, "Deleted."), **error_responses(404)},
    )
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        """Delete a file (a batch already created from it keeps its own copy)."""
        deleted = False
        if _valid_id(file_id):
            with _store_errors():
                deleted = await _store(request).delete_file(tenant_of(request), file_id)
        if not deleted:
            raise _file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @api.post(
        "/v1/batches",
        responses={**ok(Batch, "The new batch, validating."), **error_responses(400, 404)},
    )
    async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
        """Create a batch from an uploaded file; it starts in ``validating``."""
        if body.endpoint not in ENDPOINTS:
            raise BadRequest(
                f"endpoint must be one of {', '.join(ENDPOINTS)}",
                param="endpoint",
                code="invalid_value",
            )
        if body.completion_window != COMPLETION_WINDOW:
            raise BadRequest(
                f"completion_window must be {COMPLETION_WINDOW!r}",
                param="completion_window",
                code="invalid_value",
            )
        if not _valid_id(body.input_file_id):
            raise _file_not_found(body.input_file_id)
        store, tenant = _store(request), tenant_of(request)
        with _store_errors():
            file = await store.file(tenant, body.input_file_id)
            if file is None:
                raise _file_not_found(body.input_file_id)
            if file.purpose != "batch":
                raise BadRequest(
                    f"file {file.id} has purpose {file.purpose!r}, not 'batch'",
                    param="input_file_id",
                )
            limits = await services(request).auth.limits(tenant)
            state = await store.create_batch(
                tenant, file.id, body.metadata, limits.max_batches, body.endpoint
            )
        if state is None:
            raise _file_not_found(body.input_file_id)
        services(request).batch_runner.wake()
        return state.body()

    @api.get(
        "/v1/batches",
        responses={**ok(BatchList, "The tenant's batches, newest first."), **error_responses(400)},
    )
    async def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict[str, Any]:
        """The tenant's batches, newest first (``after``: the last id of the previous page)."""
        store, tenant = _store(request), tenant_of(request)
        if after is not None and not _valid_id(after):
            return {"object": "list", "data": [], "first_id": None, "last_id": None,
                    "has_more": False}  # fmt: skip
        with _store_errors():
            ids, has_more = await store.batch_ids(tenant, after, limit)
            found = [await store.batch(tenant, i) for i in ids]
        data = [b.body() for b in found if b is not None]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    @api.get(
        "/v1/batches/{batch_id}",
        responses={**ok(Batch, "The batch."), **error_responses(404)},
    )
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """One batch, with its status and request counts."""
        state = None
        if _valid_id(batch_id):
            with _store_errors():
                state = await _store(request).batch(tenant_of(request), batch_id)
        if state is None:
            raise _batch_not_found(batch_id)
        return state.body()

    @api.post(
        "/v1/batches/{batch_id}/cancel",
        responses={**ok(Batch, "The batch, cancelling."), **error_responses(404, 409)},
    )
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """Cancel a batch: ``cancelling`` now, ``cancelled`` once its running lines stop."""
        if not _valid_id(batch_id):
            raise _batch_not_found(batch_id)
        store, tenant = _store(request), tenant_of(request)
        with _store_errors():
            outcome = await store.transition(
                tenant, batch_id, ("validating", "in_progress"), "cancelling", "cancelling_at"
            )
            if outcome == "":
                raise _batch_not_found(batch_id)
            if outcome not in ("ok", "cancelling", "cancelled"):
                raise BatchConflict(f"Cannot cancel a batch with status {outcome!r}.")
            services(request).batch_runner.wake()
            state = await store.batch(tenant, batch_id)
        if state is None:
            raise _batch_not_found(batch_id)
        return state.body()

    return api
