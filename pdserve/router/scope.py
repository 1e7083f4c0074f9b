"""Cache scopes of API requests (docs/tiers.md, "Cache scopes"): whose prefix-cache hits a
request may take, so that `usage.prompt_tokens_details.cached_tokens` tells a caller nothing
about another caller's prompts.

A request's scope is its tenant combined with its `cache_salt` (vLLM's request field):

    tenant  = blake2b(the API key that authenticated it)   with cache_scope "tenant" (default)
            = ""                                            with cache_scope "shared", or no key
    salt    = ""                                  when tenant is "" and there is no cache_salt
            = blake2b(tenant, cache_salt), as hex otherwise

Workers get only the salt (`Generate.cache_salt` and its siblings), never a key, and root the
request's block-hash chain in it (kvcache/hashing.py), so equal prompts in two scopes never
share a block in any tier, nor in the router's prefix index. The salt "" is the default scope:
every caller's when no API key is configured. Warm-ups are made in the default scope, or
with `"shared": true` in the shared one, which every scope reads (router/warmup.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

from aiohttp import web

from pdserve.router.protocol import ApiError

TENANT = web.RequestKey("pdserve_tenant", str)  # set by the auth middleware on a key match
MAX_CACHE_SALT_CHARS = 256


def tenant_of(api_key: str) -> str:
    """A tenant's id: a digest of its key (the key itself never leaves the router)."""
    return hashlib.blake2b(api_key.encode(), digest_size=16, person=b"pdserve-tenant").hexdigest()


def parse_cache_salt(body: dict[str, Any]) -> str | None:
    """The body's `cache_salt` (a non-empty string of at most MAX_CACHE_SALT_CHARS, as vLLM
    takes it), None when absent, else a 400 naming it."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        message = f"cache_salt holds at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}"
        raise ApiError(400, message, param="cache_salt")
    return value


def scope_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt workers hash a request's blocks under ("" for the default scope)."""
    if not tenant and cache_salt is None:
        return ""
    data = f"{tenant}\0{cache_salt or ''}".encode()
    return hashlib.blake2b(data, digest_size=16, person=b"pdserve-scope").hexdigest()
