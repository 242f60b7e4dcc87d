"""The OpenAI Batch API: ``/v1/files`` and ``/v1/batches``, and :func:`install`, which adds
them and the batch runner to a gateway app.

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
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.exceptions import RedisError

from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.queue import JobQueue
from gateway.batches.runner import BatchRunner
from gateway.batches.store import (
    COMPLETION_WINDOW,
    ENDPOINT,
    BatchConfig,
    BatchStore,
    Status,
)
from gateway.http.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
from gateway.http.openapi import error_responses

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BatchConflict(Conflict):
    """The batch is in a state that does not allow this (409)."""

    code = "invalid_batch_state"


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


class FileObject(BaseModel):
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
    data: list[FileObject]
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


def _ok(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": description}}


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


@contextmanager
def _store_errors() -> Iterator[None]:
    """Redis down: 503 with Retry-After, like the rest of the gateway."""
    try:
        yield
    except RedisError as exc:
        raise ServiceUnavailable(
            "the batch store is unavailable", headers={"Retry-After": "1"}
        ) from exc


def _safe_filename(name: str) -> str:
    return name.encode("utf-8", "ignore").decode("utf-8")[:255] or "upload.jsonl"


def _store(request: Request) -> BatchStore:
    return request.app.state.batch_store  # type: ignore[no-any-return]


def _tenant(request: Request) -> str:
    return str(request.state.tenant)


def _valid_id(value: str) -> bool:
    return bool(_ID.match(value))


def _file_not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id", code="file_not_found")


def _batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


def _config(request: Request) -> BatchConfig:
    return request.app.state.batch_config  # type: ignore[no-any-return]


def router() -> APIRouter:
    """The ``/v1/files`` and ``/v1/batches`` routes (their knobs: ``app.state.batch_config``,
    set by :func:`install`)."""
    api = APIRouter()

    @api.post(
        "/v1/files",
        responses={**_ok(FileObject, "The stored file."), **error_responses(400)},
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
            bound = _config(request).max_file_bytes
            data = await upload.read(bound + 1)
            filename = _safe_filename(upload.filename or "")
        if len(data) > bound:
            raise PayloadTooLarge(f"the file is over {bound} bytes")
        with _store_errors():
            file = await _store(request).put_file(_tenant(request), filename, "batch", data)
        return file.body()

    @api.get(
        "/v1/files",
        responses={**_ok(FileList, "The tenant's files, newest first."), **error_responses(400)},
    )
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
    ) -> dict[str, Any]:
        """The tenant's files, newest first."""
        with _store_errors():
            files = await _store(request).files(_tenant(request))
        data = [f.body() for f in files if purpose is None or f.purpose == purpose][:limit]
        return {"object": "list", "data": data, "has_more": False}

    @api.get(
        "/v1/files/{file_id}",
        responses={**_ok(FileObject, "The file."), **error_responses(404)},
    )
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        """One file's metadata."""
        file = None
        if _valid_id(file_id):
            with _store_errors():
                file = await _store(request).file(_tenant(request), file_id)
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
                data = await _store(request).file_content(_tenant(request), file_id)
        if data is None:
            raise _file_not_found(file_id)
        return Response(data, media_type="application/jsonl")

    @api.delete(
        "/v1/files/{file_id}",
        responses={**_ok(FileDeleted, "Deleted."), **error_responses(404)},
    )
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        """Delete a file (a batch already created from it keeps its own copy)."""
        deleted = False
        if _valid_id(file_id):
            with _store_errors():
                deleted = await _store(request).delete_file(_tenant(request), file_id)
        if not deleted:
            raise _file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @api.post(
        "/v1/batches",
        responses={**_ok(Batch, "The new batch, validating."), **error_responses(400, 404)},
    )
    async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
        """Create a batch from an uploaded file; it starts in ``validating``."""
        if body.endpoint != ENDPOINT:
            raise BadRequest(
                f"endpoint must be {ENDPOINT}, the only one this server batches",
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
        store, tenant = _store(request), _tenant(request)
        with _store_errors():
            file = await store.file(tenant, body.input_file_id)
            if file is None:
                raise _file_not_found(body.input_file_id)
            if file.purpose != "batch":
                raise BadRequest(
                    f"file {file.id} has purpose {file.purpose!r}, not 'batch'",
                    param="input_file_id",
                )
            state = await store.create_batch(tenant, file.id, body.metadata)
        if state is None:
            raise _file_not_found(body.input_file_id)
        request.app.state.batch_runner.wake()
        return state.body()

    @api.get(
        "/v1/batches",
        responses={**_ok(BatchList, "The tenant's batches, newest first."), **error_responses(400)},
    )
    async def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict[str, Any]:
        """The tenant's batches, newest first (``after``: the last id of the previous page)."""
        store, tenant = _store(request), _tenant(request)
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
        responses={**_ok(Batch, "The batch."), **error_responses(404)},
    )
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """One batch, with its status and request counts."""
        state = None
        if _valid_id(batch_id):
            with _store_errors():
                state = await _store(request).batch(_tenant(request), batch_id)
        if state is None:
            raise _batch_not_found(batch_id)
        return state.body()

    @api.post(
        "/v1/batches/{batch_id}/cancel",
        responses={**_ok(Batch, "The batch, cancelling."), **error_responses(404, 409)},
    )
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        """Cancel a batch: ``cancelling`` now, ``cancelled`` once its running lines stop."""
        if not _valid_id(batch_id):
            raise _batch_not_found(batch_id)
        store, tenant = _store(request), _tenant(request)
        with _store_errors():
            outcome = await store.transition(
                tenant, batch_id, ("validating", "in_progress"), "cancelling", "cancelling_at"
            )
            if outcome == "":
                raise _batch_not_found(batch_id)
            if outcome not in ("ok", "cancelling", "cancelled"):
                raise BatchConflict(f"Cannot cancel a batch with status {outcome!r}.")
            request.app.state.batch_runner.wake()
            state = await store.batch(tenant, batch_id)
        if state is None:
            raise _batch_not_found(batch_id)
        return state.body()

    return api


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


def install(
    app: FastAPI, settings: Settings, keys: Keys, config: BatchConfig | None = None
) -> None:
    """Add the Batch API routes to ``app`` and run a :class:`BatchRunner` for the app's
    lifetime (wrapped around the app's own lifespan, whose Redis client and
    :class:`~gateway.chat.service.ChatService` it uses). Call before serving. Calling it again
    only replaces ``config`` (``None``: from the environment, ``CHARSERVE_BATCH_*``)."""
    already = hasattr(app.state, "batch_config")
    app.state.batch_config = config or BatchConfig()
    if already:
        return
    app.include_router(router())
    inner: Lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            redis = app_.state.redis
            store = BatchStore(redis, keys)
            runner = BatchRunner(
                store,
                app_.state.chat,
                JobQueue(redis, keys, settings.queue_policy),
                settings,
                app_.state.batch_config,
            )
            app_.state.batch_store = store
            app_.state.batch_runner = runner
            await runner.start()
            try:
                yield state
            finally:
                await runner.close()

    app.router.lifespan_context = lifespan
