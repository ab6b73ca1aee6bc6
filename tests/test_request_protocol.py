"""The protocol module: every rejection a 4xx in OpenAI's shape, before any pool is busy."""

import asyncio
import json
import re

import pytest

from cluster.request import protocol
from cluster.request.errors import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _status(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    body = caught.value.body()["error"]
    assert body["message"] and body["type"], body
    return caught.value


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


def test_body_over_the_limit_is_413_by_header_and_by_count():
    read = protocol.read_body
    error = asyncio.run(_expect(read(_chunks(b"x"), "5000", 1024)))
    assert error.status == 413
    # No (or a lying) Content-Length: the running count catches it.
    error = asyncio.run(_expect(read(_chunks(b"x" * 600, b"x" * 600), None, 1024)))
    assert error.status == 413
    assert asyncio.run(read(_chunks(b"ab", b"c"), "3", 1024)) == b"abc"


def test_a_client_gone_while_sending_the_body_is_499_not_a_server_bug():
    from starlette.requests import ClientDisconnect

    async def gone():
        yield b"{"
        raise ClientDisconnect()

    error = asyncio.run(_expect(protocol.read_body(gone(), None, 1024)))
    assert (error.status, error.code) == (499, "client_disconnected")


async def _expect(coroutine) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await coroutine
    return caught.value


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "words"),
    [
        (b"{}", "text/plain", 415, "Content-Type"),
        (b"{}", None, 415, "none"),
        (b'{"a": "\xff"}', "application/json", 400, "UTF-8"),
        (b'{"model": "m", "messages": [', "application/json", 400, "not valid JSON"),
        (b"[1, 2]", "application/json", 400, "JSON object"),
        (b"[" * 40 + b"]" * 40, "application/json", 400, "depth"),
    ],
)
def test_parse_rejections(raw, content_type, status, words):
    error = _status(protocol.parse, raw, content_type, "chat", 32)
    assert error.status == status and words in error.message


def test_parse_accepts_json_with_charset():
    data = protocol.parse(json.dumps(CHAT).encode(), "application/json; charset=utf-8", "chat", 32)
    assert data == CHAT


def test_json_depth_ignores_brackets_in_strings():
    assert protocol.json_depth('{"a": "[[[[{{{{", "b": [[1]]}') == 3
    assert protocol.json_depth('{"a": "\\"[[["}') == 1


def test_unknown_role_is_400_naming_it():
    data = {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}
    error = _status(protocol.check_fields, data, "chat", ["text"])
    assert error.status == 400 and "'wizard'" in error.message
    assert error.param == "messages[0].role"


def test_multi_part_text_content_passes_and_other_parts_are_named():
    parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]
    data = {**CHAT, "messages": [{"role": "user", "content": parts}]}
    protocol.check_fields(data, "chat", ["text"])
    request = protocol.validate(data, "chat")
    assert protocol.prompt_text(request) == "Describe \nthis."
    # content lists are materialized: the request pickles into the pool call
    assert isinstance(request.messages[0]["content"], list)

    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    data = {**CHAT, "messages": [{"role": "user", "content": [parts[0], image]}]}
    error = _status(protocol.check_fields, data, "chat", ["text"])
    assert error.status == 400 and "'image_url'" in error.message
    assert error.param == "messages[0].content[1].type"
    protocol.check_fields(data, "chat", ["text", "image_url"])  # a multimodal target


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"model": "m", "messages": []}, "chat"),
        ({"model": "m"}, "chat"),
        ({"model": "m", "messages": ["hi"]}, "chat"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "chat"),
        ({"model": "m", "prompt": ""}, "completions"),
        ({"model": "m", "prompt": []}, "completions"),
    ],
)
def test_empty_or_malformed_messages_and_prompts(data, kind):
    assert _status(protocol.check_fields, data, kind, ["text"]).status == 400


def test_model_validation_errors_name_the_field():
    error = _status(protocol.validate, {**CHAT, "max_tokens": "many"}, "chat")
    assert error.status == 400 and error.param == "max_tokens"


def test_context_overflow_uses_vllms_words():
    protocol.check_context(8192, 8192)
    error = _status(protocol.check_context, 8193, 8192)
    assert error.message.startswith("This model's maximum context length is 8192 tokens.")


def test_prompt_text_and_token_counts():
    request = protocol.validate({"model": "m", "prompt": [1, 2, 3]}, "completions")
    assert protocol.count_tokens(protocol.prompt_text(request), None) == 3
    request = protocol.validate({"model": "m", "prompt": "x" * 40}, "completions")
    assert protocol.count_tokens(protocol.prompt_text(request), None) == 10
    assert protocol.count_tokens("a b c", str.split) == 3
    # several prompts are several sequences: the longest is what must fit the context
    request = protocol.validate({"model": "m", "prompt": ["x" * 40, "x" * 400]}, "completions")
    assert protocol.count_tokens(protocol.prompt_text(request), None) == 100


@pytest.mark.parametrize(
    ("data", "kind", "count"),
    [({"messages": [{"role": "user", "content": "hi"}]}, "chat", 1),
     ({"messages": [{"role": "user", "content": "hi"}], "n": 4}, "chat", 4),
     ({"messages": [{"role": "user", "content": "hi"}], "n": None}, "chat", 1),
     ({"prompt": "x", "n": 3}, "completions", 3),
     ({"prompt": [1, 2, 3], "n": 2}, "completions", 2),  # token ids: one prompt
     ({"prompt": ["a", "b", "c"], "n": 2}, "completions", 6),
     ({"prompt": [[1], [2]]}, "completions", 2),
     ({"messages": [{"role": "user", "content": "hi"}], "prompt": ["a", "b"]}, "chat", 1)],
)  # fmt: skip
def test_a_request_runs_n_sequences_for_each_prompt(data, kind, count):
    assert protocol.sequences(protocol.validate({"model": "m", **data}, kind)) == count


def test_more_sequences_than_a_replica_takes_is_400_naming_n_or_the_prompts():
    def request(prompts: int, n: int):
        return protocol.validate({"model": "m", "prompt": ["a"] * prompts, "n": n}, "completions")

    assert protocol.check_sequences(request(2, 4), 8) == 8
    error = _status(protocol.check_sequences, request(3, 3), 8)
    assert (error.status, error.param) == (400, "n") and "at most 8" in error.message
    assert _status(protocol.check_sequences, request(9, 1), 8).param == "prompt"


@pytest.mark.parametrize(
    ("header", "kept"),
    [("req-42.a:b_c", True), ("r0-mixed-1024@c2-1a2b3c4d-7", True), (None, False),
     ("", False), ("a key=admin", False), ("x" * 129, False), ("x" * 128, True),
     ("a\r\nx-evil: 1", False)],
)  # fmt: skip
def test_a_client_request_id_is_kept_only_when_plain(header, kept):
    from cluster.deployments.ingress import client_request_id

    chosen = client_request_id(header)
    assert (chosen == header) is kept
    assert re.fullmatch(r"[!-~]{1,128}", chosen)
