"""Errors a worker can hit while running a job, each carrying the wire code the client
sees (see the tree in :mod:`cluster.errors`).

A :class:`JobError` is recoverable: it ends one job with an error chunk and the worker
goes on. A dead engine is not an exception here: it fails the replica's health check, Ray
Serve replaces the replica, and its leased jobs are requeued when their leases expire.
"""

from __future__ import annotations

from cluster.errors import CharserveError
from cluster.wire.vocabulary import ErrorCode


class WorkerError(CharserveError):
    """Base of worker errors. ``code`` is what the client sees in the error body."""

    code: ErrorCode = ErrorCode.INTERNAL


class JobError(WorkerError):
    """Ends one job; the worker continues."""


class InvalidJobError(JobError):
    """The job's parameters were rejected by the engine."""

    code = ErrorCode.INVALID_REQUEST


class ExpiredJobError(JobError):
    """The job's deadline passed before a worker could start it."""

    code = ErrorCode.EXPIRED
