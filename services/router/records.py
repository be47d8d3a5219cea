"""Request records in Redis (multi-host mode): status, route, timings and outcome, kept for a TTL.

Written off the event loop; a failed write is logged and never fails the request it describes.
"""

from __future__ import annotations

import logging
import time

import redis

from shared.net.registry import PREFIX

log = logging.getLogger(__name__)


class RequestRecords:
    def __init__(self, client: redis.Redis, ttl_s: int):
        self.client, self.ttl_s = client, ttl_s

    def write(self, request_id: str, fields: dict) -> None:
        key = f"{PREFIX}:request:{request_id}"
        values = {name: ("" if value is None else str(value)) for name, value in fields.items()}
        values["updated_at"] = f"{time.time():.3f}"
        try:
            with self.client.pipeline() as pipe:
                pipe.hset(key, mapping=values)
                pipe.expire(key, self.ttl_s)
                pipe.execute()
        except redis.RedisError as error:
            log.warning("request record %s not written: %s", request_id, error)
