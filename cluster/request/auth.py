"""API keys: SHA-256 hashes with scopes, from the config, an environment variable or a file.

A presented key is hashed and looked up by its hash, so the key itself is never stored,
compared or logged; what the logs see is the key's `name`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import TypeAdapter

from cluster.config import ApiKey, AuthConfig
from cluster.request.errors import ApiError

INFERENCE, ADMIN = "inference", "admin"
_KEY_LIST = TypeAdapter(list[ApiKey])


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    """Who may call what. `open` (auth not required, loopback only) lets every request in."""

    def __init__(self, keys: list[ApiKey], required: bool):
        self._by_hash = {key.sha256: key for key in keys}
        self.required = required

    @classmethod
    def load(cls, config: AuthConfig, keys_file: str | None) -> KeyStore:
        """Keys from the config, `config.keys_env` and `keys_file` (already resolved against
        the config file's directory). Required auth with no key at all refuses to start."""
        keys = list(config.keys)
        raw_env = os.environ.get(config.keys_env, "") if config.keys_env else ""
        if raw_env.strip():
            keys += _parse(raw_env, f"${config.keys_env}")
        if keys_file:
            keys += _parse(Path(keys_file).read_text(), keys_file)
        if config.required and not keys:
            raise ValueError(
                "server.auth.required: no API keys configured (server.auth.keys, "
                f"${config.keys_env or 'CLUSTER_API_KEYS'} or server.auth.keys_file)"
            )
        return cls(keys, config.required)

    def authorize(self, authorization: str | None, scope: str) -> str | None:
        """The caller's key name; 401 without a valid key, 403 without `scope`."""
        if not self.required:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        key = self._by_hash.get(hash_key(token.strip()))
        if key is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        if scope not in key.scopes:
            raise ApiError(
                403, f"API key {key.name!r} lacks the {scope!r} scope", code="insufficient_scope"
            )
        return key.name


def _parse(text: str, source: str) -> list[ApiKey]:
    try:
        return _KEY_LIST.validate_python(json.loads(text))
    except ValueError as error:
        # Only the source and pydantic's field paths: the text may hold secrets.
        raise ValueError(
            f"{source}: not a JSON list of {{name, sha256, scopes}}: {type(error).__name__}"
        ) from None
