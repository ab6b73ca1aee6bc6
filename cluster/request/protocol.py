"""HTTP body -> OpenAI request model, with every rejection a 4xx in OpenAI's shape.

The request models are `ray.serve.llm`'s public ones (vLLM's OpenAI models), so pools receive
exactly what Ray Serve LLM's own ingress would send them. Checks run cheapest first: size
(413), content type (415), encoding, JSON syntax and depth, then the fields vLLM's models accept
too loosely (unknown roles, content parts the target cannot take, empty prompts), then the
models themselves. Token counting (routing, context length) runs in a worker thread: a
multi-megabyte prompt must not stall every other request on the ingress's event loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from starlette.requests import ClientDisconnect

from cluster.request.errors import ApiError

ENDPOINTS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
}
"""Pool handle method -> request model; the method names are `LLMServer`'s public ones."""

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""Chat roles OpenAI defines; vLLM's models accept any string, its chat template may not."""


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed `limit` bytes (a lying or
    absent Content-Length does not get past the running count)."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise _too_large(int(content_length), limit)
    body = bytearray()
    try:
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                raise _too_large(len(body), limit)
    except ClientDisconnect:  # nobody reads the answer; counted, not logged as a server bug
        raise ApiError(
            CLIENT_CLOSED_REQUEST, "the client disconnected while sending the body",
            code="client_disconnected",
        ) from None  # fmt: skip
    return bytes(body)


CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away: what the rejection metric counts."""


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of at least {size} bytes exceeds the limit of {limit}")


def parse(raw: bytes, content_type: str | None, kind: str, max_depth: int) -> dict[str, Any]:
    """Bytes -> the JSON object of a `kind` request (before model validation)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415, f"Content-Type must be application/json, got {content_type or 'none'!r}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {error.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise ApiError(400, f"JSON nesting depth {depth} exceeds the limit of {max_depth}")
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def json_depth(text: str) -> int:
    """Deepest array/object nesting of a JSON text, without parsing it (json.loads recurses
    and would hit the interpreter's recursion limit first)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def check_fields(data: dict[str, Any], kind: str, part_types: list[str]) -> None:
    """What vLLM's models let through but no pool can serve."""
    if kind == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            _check_message(i, message, part_types)
    else:
        prompt = data.get("prompt")
        if prompt in ("", [], None):
            raise ApiError(400, "prompt: must not be empty", param="prompt")


def _check_message(i: int, message: Any, part_types: list[str]) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where}: must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(
            400, f"{where}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}",
            param=f"{where}.role",
        )  # fmt: skip
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: must be a string or a list of parts", param=where)
    allowed = [*part_types, "refusal"] if role == "assistant" else part_types
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ApiError(
                400,
                f"{where}.content[{j}]: content part type {kind!r} is not supported by this "
                f"model (supported: {', '.join(allowed)})",
                param=f"{where}.content[{j}].type",
            )
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}].text: must be a string", param=where)


def validate(data: dict[str, Any], kind: str) -> BaseModel:
    """The request model, or a 400 naming the first bad field."""
    try:
        request = ENDPOINTS[kind].model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise ApiError(
            400, f"{param}: {message}{more}" if param else message, param=param
        ) from None
    if kind == "chat":
        _materialize(request)
    return request


def _materialize(request: Any) -> None:
    # Pydantic keeps `Iterable[...]` fields (message content, tool calls) as one-shot
    # ValidatorIterators, which cannot be pickled into the pool call (pydantic#9467).
    for i, message in enumerate(request.messages):
        if not isinstance(message, dict):
            request.messages[i] = message = message.model_dump()
        for key in ("content", "tool_calls"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                message[key] = list(value)


def prompt_text(request: Any) -> str | list[int]:
    """The text (or token ids) a request's prompt consists of, for counting tokens. Chat
    templates add a few tokens per message; this is the lower bound."""
    if isinstance(request, ChatCompletionRequest):
        parts = []
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif content:
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return max(prompt, key=len)  # the longest of several token-id prompts
    if isinstance(prompt, list):  # several prompts, each its own sequence: the longest counts
        return max((p for p in prompt if isinstance(p, str)), key=len, default="")
    return prompt or ""


def count_tokens(text: str | list[int], encode: Callable[[str], list[int]] | None) -> int:
    """Prompt tokens; chars/4 when the target has no local tokenizer."""
    if isinstance(text, list):
        return len(text)
    return len(encode(text)) if encode is not None else len(text) // 4


def check_context(prompt_tokens: int, max_model_len: int | None) -> None:
    """A prompt that cannot fit the context: a 400 in vLLM's words, before any pool is busy."""
    if max_model_len is not None and prompt_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )


def sequences(request: Any) -> int:
    """Sequences the engine runs at once for a request: `n` for each prompt (with beam search,
    `n` is the beam width); a completions request's prompts (and prompt embeddings, which
    vLLM runs beside them) are each their own."""
    n = _choices(request)
    if not isinstance(request, CompletionRequest):
        return n
    prompt, embeds = request.prompt, request.prompt_embeds
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    prompts = len(prompt) if several else int(prompt is not None)
    prompts += len(embeds) if isinstance(embeds, list) else int(embeds is not None)
    return n * max(prompts, 1)


def _choices(request: Any) -> int:
    return max(request.n or 1, 1)


def check_sequences(request: Any, per_replica: int) -> int:
    """The request's `sequences`; a 400 when that is more than any of its pools' replicas
    takes at once (not a wait that cannot end)."""
    count = sequences(request)
    if count > per_replica:
        param = "n" if _choices(request) > 1 else "prompt"
        raise ApiError(
            400,
            f"{param}: this request runs {count} sequences at once (n for each prompt); a "
            f"replica of this model takes at most {per_replica} (max_ongoing_requests)",
            param=param,
        )
    return count


ROUTED_OUTPUT_TOKENS_CAP = 1 << 20
"""The most output tokens routing assumes for a request: any `int` validates, and one past a
float's range would fail the prediction (500); the engine answers an out-of-range limit itself."""


def routed_max_tokens(body: Any) -> int | None:
    """The request's output limit (chat's newer field first), if it set one, within
    1..`ROUTED_OUTPUT_TOKENS_CAP` for routing."""
    limit = getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None)
    return None if limit is None else min(max(limit, 1), ROUTED_OUTPUT_TOKENS_CAP)
