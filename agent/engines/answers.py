"""Reading an engine's answer to a control call (sleep, wake, adapters): one field of its JSON body, and its
words cut to a length a status message can carry."""

from __future__ import annotations

import httpx

ANSWER_SHOWN = 300


def json_field(answer: httpx.Response, name: str) -> object:
    """Field `name` of an answer's JSON object; None if the answer is not one or lacks it."""
    try:
        body = answer.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None


def shown(text: str) -> str:
    """An engine's words, stripped and cut to ANSWER_SHOWN characters."""
    text = text.strip()
    return text if len(text) <= ANSWER_SHOWN else text[:ANSWER_SHOWN] + "…"
