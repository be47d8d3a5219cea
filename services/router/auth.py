"""API keys: only hashes are kept (SHA-256), in memory or in Redis; comparison is constant-time.

Keys are random tokens, not passwords, so a fast unsalted hash is enough to keep them out of
memory dumps and Redis; a slow KDF would only slow every request.

While Redis cannot be reached, a key Redis accepted before is accepted still (a key revoked
meanwhile is refused once Redis answers again); a key the gateway has never seen cannot be
checked, and gets a 503 that says so rather than a 401 that would call a good key bad.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import redis
from fastapi import Request

from services.router.admission import off_loop
from shared.api.serving import RequestError
from shared.net.registry import PREFIX

API_KEYS = f"{PREFIX}:apikeys"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_key(client: redis.Redis, key: str) -> None:
    client.sadd(API_KEYS, hash_key(key))


class KeyUnverifiable(Exception):
    """A key only Redis could vouch for, while Redis cannot be reached (503)."""


class KeyStore:
    def __init__(self, keys: list[str], required: bool, client: redis.Redis | None = None):
        self.hashes = [hash_key(key) for key in keys]
        self.required, self.client = required, client
        self._vouched: set[str] = set()  # hashes Redis accepted: what a Redis outage still accepts
        self._stored_any = False  # whether Redis held any key when last asked

    def enabled(self) -> bool:
        if self.required or self.hashes:
            return True
        if self.client is None:
            return False
        try:
            self._stored_any = self.client.scard(API_KEYS) > 0
        except redis.RedisError:
            pass  # as it was when Redis last answered
        return self._stored_any

    def caller(self, presented: str | None, address: str) -> str | None:
        """Who is asking, for the per-caller limit: the key's hash when keys are on (None if the key
        is refused), the client's address when they are off (whatever token it sent)."""
        if not self.enabled():
            return address
        return hash_key(presented) if self.accepts(presented) else None

    def identify(self, presented: str | None, address: str) -> tuple[str | None, str]:
        """(caller, cache salt): the caller as `caller` says; the salt is the prefix cache's
        tenant, made here and never sent by the client: the key's hash when keys are on (tenants
        never share entries, so a cache hit's timing cannot tell one tenant another's prompt), one
        salt for everyone when they are off."""
        if not self.enabled():
            return address, ""
        return (hash_key(presented), hash_key(presented)) if self.accepts(presented) else (None, "")

    def accepts(self, presented: str | None) -> bool:
        if not self.enabled():
            return True
        if not presented:
            return False
        digest = hash_key(presented)
        # Compare against every stored hash, so the time taken does not depend on which matched.
        matched = False
        for stored in self.hashes:
            matched |= hmac.compare_digest(stored, digest)
        if not matched and self.client is not None:
            try:
                matched = bool(self.client.sismember(API_KEYS, digest))
            except redis.RedisError:
                if digest in self._vouched:
                    return True
                raise KeyUnverifiable(
                    "the API key cannot be checked while shared state (Redis) is unavailable; retry shortly"
                ) from None
            if matched:
                self._vouched.add(digest)
            else:
                self._vouched.discard(digest)
        return matched


@dataclass(frozen=True)
class Caller:
    """Who is asking: `id` is a key's hash, or the client's address without keys (the per-caller
    bound and the queue's turns count by it); `salt` is the prefix cache's tenant for them."""

    id: str
    salt: str


async def caller_of(request: Request) -> Caller:
    """FastAPI dependency of every route behind the API key: the caller, or a 401. The key store
    may ask Redis, so it runs in a thread."""
    keys: KeyStore = request.app.state.keys
    header = request.headers.get("authorization", "")
    presented = header[7:].strip() if header.lower().startswith("bearer ") else None
    address = request.client.host if request.client else "?"
    caller, salt = await off_loop(keys.identify, presented, address)
    if caller is None:
        raise RequestError(
            401, "missing or invalid API key (send it as `Authorization: Bearer KEY`)", code="invalid_api_key"
        )
    return Caller(caller, salt)
