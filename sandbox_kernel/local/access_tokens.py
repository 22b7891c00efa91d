"""Per-sandbox access tokens (createos-api.md §15.4): a key that operates one sandbox only.

The owner's API key creates, inspects, rotates and disables a sandbox's token; the token,
sent in `X-Api-Key` like a key, reaches that sandbox's own routes and nothing else (no
listing, no create, no other sandbox, no token management). The engine keeps only a
SHA-256 of each token: the plaintext is shown once, on create and rotate.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sandbox_kernel.api.models import WireModel

TOKEN_PREFIX = "sbt_"
HINT_CHARS = 4
# The routes a token may use: its sandbox's view and everything under it, except the
# token routes themselves (only the owner manages tokens) and fork (it makes another
# sandbox, an account resource, like create).
SANDBOX_ROUTE = re.compile(r"^/v1/sandboxes/(?P<id>[^/]+)(?P<rest>/.*)?$")
OWNER_ONLY = ("/access-token", "/fork")


class AccessTokenCreated(WireModel):
    token: str
    enabled: bool
    created_at: str
    rotated_at: str | None = None


class AccessTokenMetadata(WireModel):
    enabled: bool
    token_hint: str | None = None
    created_at: str | None = None
    rotated_at: str | None = None


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass
class AccessToken:
    """One sandbox's token: its hash, a hint of its last characters, and when it changed."""

    hashed: bytes
    hint: str
    created_at: float
    rotated_at: float | None = None
    enabled: bool = True

    @classmethod
    def issue(cls, previous: AccessToken | None = None) -> tuple[AccessToken, str]:
        """A fresh token (its plaintext is the second item); `previous` keeps its creation time."""
        plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        token = cls(hashed=digest(plaintext), hint="…" + plaintext[-HINT_CHARS:],
                    created_at=previous.created_at if previous else now,
                    rotated_at=now if previous else None)
        return token, plaintext

    def accepts(self, offered: bytes) -> bool:
        """Whether `offered` (a digest) is this enabled token, compared in constant time."""
        return self.enabled and hmac.compare_digest(self.hashed, offered)


def token_may_use(path: str, sandbox_id: str) -> bool:
    """Whether a token bound to `sandbox_id` may call a route at `path`."""
    match = SANDBOX_ROUTE.match(path)
    if not match or match["id"] != sandbox_id:
        return False
    return not (match["rest"] or "").startswith(OWNER_ONLY)
