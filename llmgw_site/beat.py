"""The beat scheduler: RedBeat, which keeps the schedule and a lock in Redis so every control-plane
host can run a beat and exactly one sends ticks — made to survive Redis losing its data or going away.

A Redis restarted without persistence (as docs/running.md runs it) comes back empty: the holder's lock is
gone (RedBeat would crash on its next extend) and so is the schedule (a beat holding the lock would
find nothing to send, so no tick would ever run again). Before each of its loops this scheduler
takes the lock again if it lost it (waiting while another beat holds it) and installs the schedule
again if it is missing; while Redis is unreachable it waits and retries instead of exiting.
"""

from __future__ import annotations

import logging

import redis
from redbeat.schedulers import RedBeatScheduler, get_redis

log = logging.getLogger(__name__)


class RecoveringRedBeatScheduler(RedBeatScheduler):
    """RedBeat that takes its lock again and re-installs the static schedule after Redis lost them."""

    def tick(self, *args, **kwargs):
        try:
            if self.lock is not None and not self.lock.owned():
                log.warning("beat: the lock is gone (Redis restarted?); taking it again, or waiting for it")
                self.lock.acquire()  # blocks while another beat holds it: this one is then the standby
                log.info("beat: Acquired lock")
            if not get_redis(self.app).exists(self.app.redbeat_conf.schedule_key):
                log.warning("beat: the schedule is gone from Redis (restarted empty?); installing it again")
                self.setup_schedule()
            return super().tick(*args, **kwargs)
        except redis.RedisError as exc:
            log.warning("beat: Redis is unreachable, retrying: %s", exc)
            return self.max_interval
