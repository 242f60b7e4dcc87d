"""The Ray Serve autoscaling policy that scales replicas on the Redis queue.

Named in a Serve config as::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 8
      upscale_delay_s: 5
      downscale_delay_s: 120
      policy:
        policy_function: workers.scaling.policy:BacklogPolicy
        policy_kwargs: {target_utilization: 0.75}   # redis_url etc. filled by charserve deploy

Serve imports this module, pickles the class by value and instantiates it once in its
controller with ``policy_kwargs`` (Ray 2.60 ``AutoscalingPolicy``). The signal and the
arithmetic live in :mod:`workers.scaling.backlog`, which the controller imports normally, so
charserve must be installed where the Serve controller runs (the head node), as it is in
the images this project builds. Serve applies the bounds and the up/down delays to what
:meth:`BacklogPolicy.__call__` returns.

Scale-down loses nothing: Serve stops a replica gracefully, its ``__del__`` stops
claiming, lets running replies finish for ``drain_timeout_s`` and hands the rest back to
the queue (see :class:`workers.loop.consumer.Consumer`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import structlog

from workers.scaling.backlog import BacklogConfig, BacklogWatch, decide

log = structlog.get_logger("workers.scaling.policy")


class BacklogPolicy:
    """Desired replicas from the queue's backlog against its deadlines and the work
    running now (see :mod:`workers.scaling.backlog`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.config = BacklogConfig.model_validate(kwargs)  # a typo raises here
        self._watch: BacklogWatch | None = None
        if self.config.redis_url:
            self._watch = BacklogWatch(self.config)
            # The watch's thread outlives no policy: stop it when Serve drops this
            # instance (a redeploy builds a new one).
            weakref.finalize(self, self._watch.stop)
        else:
            # Raising here would fail inside the Serve controller; holding is harmless.
            log.error(
                "BacklogPolicy has no redis_url (charserve deploy fills it): replicas stay "
                "where they are"
            )
        self._last_replicas: int | None = None

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """Serve's policy call: ``(desired replicas, policy state)``."""
        if self._watch is None:
            return ctx.target_num_replicas, {}
        self._watch.start()
        reading = self._watch.latest()
        if reading is None:
            # No fresh view of the queue: hold rather than scale down blind.
            return ctx.target_num_replicas, {}
        decision = decide(reading.snapshot, reading.job_s, self.config)
        wanted = math.ceil(decision.replicas)
        if wanted != self._last_replicas:
            log.info(
                "backlog policy",
                deployment=ctx.deployment_name,
                current=ctx.current_num_replicas,
                desired=wanted,
                ongoing=round(decision.ongoing, 2),
                deadlines=round(decision.deadlines, 2),
                waiting=reading.snapshot.waiting,
                claimed=reading.snapshot.claimed,
                job_s=round(decision.job_s, 2),
            )
            self._last_replicas = wanted
        return decision.replicas, {}
