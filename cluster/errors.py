"""The one exception tree of charserve: every error it raises on purpose derives from
:class:`CharserveError`.

The branches say what the caller can do about an error; the leaves live beside the code
that raises them (the module in brackets), so each package keeps its own words::

    CharserveError
    ├── InvalidInput (ValueError)     refused before any work is done; the input must change
    │   ├── ProtocolError             a wire message that does not decode [here]
    │   ├── ConfigError               a setting, Serve config or deploy that cannot work [here]
    │   ├── CardError                 a character card that cannot be imported
    │   │                             [cluster.characters.cards]
    │   ├── PromptTooLong             the persona and the latest message do not fit
    │   │                             [cluster.characters.persona]
    │   └── LineError                 one backfill line that cannot run [cluster.backfill.plan]
    ├── Disconnected                  the other end went away; nothing to answer
    │   ├── ClientGone                the client left before its reply started
    │   │                             [gateway.chat.call]
    │   └── SlowConsumer              a reader fell a whole queue behind
    │                                 [gateway.streaming.relay]
    ├── APIError                      answered to an HTTP client: status, OpenAI error body
    │   │                             [gateway.http.errors]
    │   ├── BadRequest 400, Unauthorized 401, NotFound 404, Conflict 409,
    │   │   PayloadTooLarge 413, TooManyRequests 429, SlowClient 429 (in a stream),
    │   │   ServiceUnavailable 503, GatewayTimeout 504
    │   └── (route-specific leaves: CardRejected, BatchConflict)
    ├── WorkerError                   raised in a worker; carries the wire ErrorCode
    │   │                             [workers.errors]
    │   └── JobError                  recoverable: ends one job, the worker goes on
    │       ├── InvalidJobError       the engine refused the job's parameters
    │       └── ExpiredJobError       the deadline passed before the job could start
    └── ProtocolViolation             a benchmarked server's response cannot be parsed
                                      [cluster.bench.lean_client]

Fatal conditions are not exceptions of this tree: a dead engine fails the replica's
health check and Ray Serve replaces the replica, whose leased jobs are requeued.
"""

from __future__ import annotations


class CharserveError(Exception):
    """Base of every error charserve raises on purpose."""


class InvalidInput(CharserveError, ValueError):
    """Input refused before any work was done (a ``ValueError``, so generic validation
    code handles it too)."""


class ProtocolError(InvalidInput):
    """A message could not be decoded: wrong kind, unknown version, or wrong shape."""


class ConfigError(InvalidInput):
    """A setting, Serve config or deploy that cannot work; the message says why."""


class Disconnected(CharserveError):
    """The other end of a stream went away."""
