"""OpenAI-shaped errors and the one table that maps every failure on the request path to one.

`{"error": {"message", "type", "param", "code"}}` is what the `openai` client parses; FastAPI's
`{"detail": ...}` is never sent. Overload is 429 (a queue is full) or 503 (nothing could take
the request in time), both with `Retry-After`; a pool that fails a request is 502/503; only a
bug in the ingress itself is a 500.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A request that ends with an error answer; `retryable` failures may go to another pool."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        retryable: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
        self.retryable = retryable

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers={**self.headers(), **(headers or {})}
        )

    def sse(self) -> str:
        """The error as one server-sent event (what a stream ends with after a failure)."""
        return f"data: {json.dumps(self.body())}\n\n"


def from_exception(error: BaseException, retry_after_s: int) -> ApiError:
    """The one table: any failure of a pool call -> the answer the client gets."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, BackPressureError):
        return ApiError(
            429, "the pool's queue is full; retry later", code="pool_queue_full",
            retry_after_s=retry_after_s, retryable=True,
        )  # fmt: skip
    if isinstance(error, TimeoutError | asyncio.TimeoutError):
        return ApiError(
            503, "no replica could take the request in time; retry later", code="pool_timeout",
            retry_after_s=retry_after_s,
        )  # fmt: skip
    if isinstance(
        error,
        DeploymentUnavailableError | ReplicaUnavailableError | ActorUnavailableError,
    ):
        return ApiError(
            503, "the pool is unavailable; retry later", code="pool_unavailable",
            retry_after_s=retry_after_s, retryable=True,
        )  # fmt: skip
    if isinstance(error, ActorDiedError | RayActorError):
        return ApiError(
            502, "the replica serving the request failed", code="replica_failed", retryable=True
        )
    return ApiError(502, "the pool failed the request", code="pool_error", retryable=True)


def from_pool_error(error: Any) -> ApiError:
    """An `ErrorResponse` a pool returned: its own status and words; 5xx may be retried."""
    inner = error.error
    return _pool_error(getattr(inner, "code", 500), inner.message, getattr(inner, "param", None))


def from_streamed_error(text: str) -> ApiError | None:
    """The error in a streamed pool item that is an SSE error event (`data: {"error": ...}`),
    else None: vLLM reports an engine failure inside a stream as text, not as an
    `ErrorResponse` (and ends the stream after it)."""
    payload = text.removeprefix("data: ").strip()
    if not payload.startswith('{"error"'):
        return None
    try:
        inner = json.loads(payload)["error"]
    except (ValueError, KeyError):
        return None
    if not isinstance(inner, dict):
        return None
    return _pool_error(inner.get("code"), str(inner.get("message", "")), inner.get("param"))


def _pool_error(code: Any, message: str, param: Any) -> ApiError:
    try:
        status = int(code or 500)
    except (TypeError, ValueError):
        status = 500
    return ApiError(
        status,
        message or "the engine failed",
        param=param,
        code=None if status < 500 else "pool_error",
        retryable=status >= 500,
    )


def is_pool_error(item: Any) -> bool:
    """Whether a pool's output item is an OpenAI `ErrorResponse` (by shape: the pool returns
    Ray's internal model class, which the public `ray.serve.llm` subclasses)."""
    return "error" in getattr(type(item), "model_fields", {})
