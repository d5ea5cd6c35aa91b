"""A Redis server as shared KV page storage (pipelined batches, short socket timeouts)."""

from __future__ import annotations

from strata.cache.storage import StorageError


class RedisStorage:
    name = "redis"

    def __init__(self, url: str, timeout_s: float = 2.0, ttl_s: int | None = None):
        import redis

        self._redis = redis
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self.ttl_s = ttl_s

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
            return list(self.client.mget(keys)) if keys else []
        except self._redis.RedisError as exc:
            raise StorageError(f"redis get failed: {exc}") from exc

    def set(self, items: list[tuple[str, bytes]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(key, data, ex=self.ttl_s)
            pipe.execute()
        except self._redis.RedisError as exc:
            raise StorageError(f"redis set failed: {exc}") from exc

    def close(self) -> None:
        self.client.close()
