"""Errors a worker can hit while running a job, and the wire codes they map to.

Recoverable errors end one job with an error chunk; the worker goes on. Fatal errors
(the engine died) stop the replica so Ray Serve replaces it, and its leased jobs are
requeued when their leases expire.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of worker errors. ``code`` is what the client sees in the error body."""

    code = "internal_error"


class JobError(WorkerError):
    """Ends one job; the worker continues."""


class InvalidJobError(JobError):
    """The job's parameters were rejected by the engine."""

    code = "invalid_request_error"


class ExpiredJobError(JobError):
    """The job's deadline passed before a worker could start it."""

    code = "expired"


class EngineDeadError(WorkerError):
    """The engine is gone: the replica must be replaced."""

    code = "engine_dead"
