"""A Redis server as shared KV page storage (pipelined batches, short socket timeouts).

Pages expire `ttl_s` after their last use: written with an expiry, which a hit renews (in the same
round trip as the read). Size is the server's to bound (`maxmemory` with an `allkeys-lru` policy).
"""

from __future__ import annotations

from strata.cache.storage.base import StorageError


class RedisStorage:
    name = "redis"

    def __init__(self, url: str, timeout_s: float = 2.0, ttl_s: float | None = None):
        import redis

        self._redis = redis
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))

    def exists(self, keys: list[str]) -> list[bool]:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(x) for x in pipe.execute()]
        except self._redis.RedisError as exc:
            raise StorageError(f"redis exists failed: {exc}") from exc

    def get(self, keys: list[str]) -> list[bytes | None]:
        try:
            if not keys:
                return []
            if self.ttl_ms is None:
                return list(self.client.mget(keys))  # type: ignore[arg-type]  # bytes: no decode_responses
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pexpire(key, self.ttl_ms)  # a no-op on a missing key
            return pipe.execute()[::2]
        except self._redis.RedisError as exc:
            raise StorageError(f"redis get failed: {exc}") from exc

    def set(self, items: list[tuple[str, bytes]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(key, data, px=self.ttl_ms)
            pipe.execute()
        except self._redis.RedisError as exc:
            raise StorageError(f"redis set failed: {exc}") from exc

    def close(self) -> None:
        self.client.close()
