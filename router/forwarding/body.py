"""Decoding a request body into a JSON object, with every way it can be wrong named in OpenAI's shape.

Nothing a client sends may become a 500: bad UTF-8, bad JSON, numbers Python
refuses to convert, a non-object, and nesting deeper than MAX_JSON_DEPTH
(which would otherwise exhaust the parser's recursion) are each a 400 that says
what is wrong, in JSON's own type names.

Cost: the depth check is two `bytes.count` calls for a body with at most
MAX_JSON_DEPTH brackets (almost every request); only bodies with more brackets
pay a linear pass to measure their real depth. Bodies are decoded with msgspec
(several times faster than `json`); one it refuses is decoded again with
`json`, which accepts what it always did (NaN, lone surrogates) and words the
error when there is one, so the faster decoder changes no answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from router.errors import RouterError

# Far deeper than any real request (tool schemas nest a few dozen levels at most), and far below
# the recursion limit of the C parser, so json.loads never raises RecursionError.
MAX_JSON_DEPTH = 128
# Longest part of a client's value quoted back in an error message.
ECHO_CHARS = 200

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_FAST_DECODER = msgspec.json.Decoder()
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")

JSON_TYPE_NAMES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (`null`, never `NoneType`)."""
    return JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def echo(text: str) -> str:
    """A client's value as quoted in an error: bounded in length."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"


def nesting_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the arrays and objects in `body` nest more than `limit` deep (unbalanced opens count)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    if b"\\" in body:
        body = _ESCAPE.sub(b"", body)
    # With escapes gone no string holds a quote: every other piece between quotes is outside strings.
    brackets = b"".join(body.split(b'"')[::2]).translate(_AS_SQUARE, _NOT_BRACKETS)
    # Each pass removes the innermost level of every nest, so the passes needed are the depth.
    for level in range(limit):
        if len(brackets) // 2 <= limit - level:
            return False
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            # Unbalanced: the parser recurses into every open that never closes before it fails.
            return level + brackets.count(b"[") > limit
        brackets = shorter
    return bool(brackets)


def decode_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 RouterError naming what is wrong with it."""
    # The quick test of nesting_depth_exceeds, first here: almost every body passes it, and spares the call.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and nesting_depth_exceeds(body):
        raise RouterError(
            400, f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.", "invalid_json"
        )
    try:
        payload = _FAST_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        payload = _decode_slowly(body)
    if not isinstance(payload, dict):
        raise RouterError(400, f"The request body must be a JSON object, not {json_type(payload)}.", "invalid_body")
    return payload


def _decode_slowly(body: bytes) -> Any:
    """`body` decoded by `json`, or a 400 RouterError naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RouterError(
            400,
            f"The request body is not valid UTF-8: byte 0x{body[exc.start]:02x} at position {exc.start}.",
            "invalid_json",
        ) from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RouterError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    except (ValueError, RecursionError) as exc:
        # Integers of more than 4300 digits (CPython's conversion limit) and the like.
        raise RouterError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    return payload


def requested_model(payload: dict[str, Any]) -> str:
    """The body's `model`: a non-empty string, or a 400 naming the field."""
    requested = payload.get("model")
    if requested is None:
        problem = "is missing" if "model" not in payload else "is null"
    elif not isinstance(requested, str):
        problem = f"must be a string, not {json_type(requested)}"
    elif not requested:
        problem = "must not be empty"
    else:
        return requested
    raise RouterError(
        400,
        f'The request body\'s "model" {problem}: name the model to use, e.g. "model": "my-model".',
        "missing_model",
        param="model",
    )
