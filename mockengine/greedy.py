"""The mock engine's greedy mode (`--greedy`): answers as greedy decoding of a real language model gives them.

A token is a word (as `words()` splits text) and its id is `crc32(word) & 0x7FFFFFFF`, so a word means the same id
wherever it comes from: a prompt, a chat message, or an answer sent back as the start of the next request. The
context is a list of ids: a completion's prompt words, or its prompt given as ids (vLLM accepts those); a chat's
messages, each as its role token `<role>`, its words and `<end>`, then `<assistant>` when `add_generation_prompt`
(the default) asks for a generation prompt. With `continue_final_message` the last message, which must be the
assistant's, stays open: no `<end>`, no generation prompt, and the answer goes on from its words.

The next token is a pure function of the context: a rolling hash of its ids (MULTIPLIER, mod MODULUS, from SEED)
picks a word of VOCAB, whose id is folded in before the next pick. No end of sequence: an answer has exactly
`max_tokens` tokens and ends with `length`. Without a limit it runs, as vLLM's does, to the end of the model's
context (CONTEXT_TOKENS, context and answer together): a chat that names none, or a completion whose limit is an
explicit null; a completion that names none gets DEFAULT_MAX_TOKENS, vLLM's and OpenAI's default. So
what continues a context extended by the first k generated tokens is exactly the answer's remaining tokens,
which is what a router resuming a broken stream on another replica must get.

Token texts: a completion's token is " word"; a chat answer's is the same except its very first word, bare, when
the answer has no content yet (no final message continued, or an empty one). Joined, a chat answer reads
"w1 w2 …", and a continuation of "w1 … wk" adds " w(k+1) …".
"""

from __future__ import annotations

import zlib

from mockengine.text import BadRequest, content_text, words

__all__ = [
    "CONTEXT_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "VOCAB",
    "answer_ids",
    "chat_context",
    "next_words",
    "prompt_ids",
    "return_token_ids",
    "token_id",
    "token_texts",
]

MODULUS = 2**61 - 1  # a Mersenne prime: the rolling hash mixes every id of the context
MULTIPLIER = 1_000_003
SEED = 0x5EED_C0DE_2024
DEFAULT_MAX_TOKENS = 16
CONTEXT_TOKENS = 64  # the greedy model's context length (vLLM's max_model_len)
# Ids are 31-bit, as crc32 & 0x7FFFFFFF makes them; a prompt of ids must stay in that range.
ID_LIMIT = 2**31
END, GENERATION_PROMPT = "<end>", "<assistant>"


def _vocabulary() -> tuple[str, ...]:
    """512 distinct pronounceable pseudo-words: onset × vowel × coda (a vowel run parses unambiguously between
    the one-letter onset and the consonant coda, so no two combinations spell the same word)."""
    onsets = "bdfghjklmnprstvz"
    vowels = ("a", "e", "i", "o", "u", "ai", "ea", "oo")
    codas = ("", "n", "r", "s")
    return tuple(onset + vowel + coda for onset in onsets for vowel in vowels for coda in codas)


VOCAB = _vocabulary()


def token_id(word: str) -> int:
    """The id of a word: the same for the same word wherever it comes from."""
    return zlib.crc32(word.encode()) & 0x7FFFFFFF


_VOCAB_IDS = tuple(token_id(word) for word in VOCAB)
_ID_OF = dict(zip(VOCAB, _VOCAB_IDS, strict=True))


def answer_ids(answer: list[str]) -> list[int]:
    """The ids of words next_words produced (looked up, not hashed again)."""
    return [_ID_OF[word] for word in answer]


def next_words(context: list[int], count: int) -> list[str]:
    """The `count` words greedy decoding produces after `context` (ids)."""
    # The fold written out, and each word's id looked up: a continuation's context is thousands of ids, and an
    # engine handed hundreds of them at once (a replica lost) should spend its time answering, not here.
    # +1 so that id 0 still moves the state.
    state, multiplier, modulus = SEED, MULTIPLIER, MODULUS
    for token in context:
        state = (state * multiplier + token + 1) % modulus
    produced, size = [], len(VOCAB)
    for _ in range(count):
        pick = state % size
        produced.append(VOCAB[pick])
        state = (state * multiplier + _VOCAB_IDS[pick] + 1) % modulus
    return produced


def token_texts(answer: list[str], bare_first: bool) -> list[str]:
    """Each token's text as streamed: " word", but the first bare when `bare_first` (a chat answer with no
    content yet)."""
    return [word if bare_first and i == 0 else " " + word for i, word in enumerate(answer)]


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"field “{name}” must be a boolean", name)
    return value


def return_token_ids(body: dict) -> bool:
    """The request's `return_token_ids` (vLLM's): whether the answer carries the prompt's and its own ids."""
    return _flag(body, "return_token_ids", False)


def prompt_ids(prompt: object) -> list[int] | None:
    """A completion prompt given as token ids (a non-empty list that is not all strings), checked; None for a
    text prompt, which the caller handles."""
    if not isinstance(prompt, list) or not prompt or all(isinstance(p, str) for p in prompt):
        return None
    # Checked at C speed first (a continuation's prompt is thousands of ids); bool is an int to Python, never to a
    # tokenizer.
    if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= ID_LIMIT:
        for token in prompt:
            if type(token) is not int or not 0 <= token < ID_LIMIT:
                raise BadRequest(f"prompt token ids must be integers from 0 to {ID_LIMIT - 1}, got {token!r}", "prompt")
    return list(prompt)


def chat_context(messages: list[dict], body: dict) -> tuple[list[int], bool]:
    """The context ids of a chat request (messages already checked to be objects with a string role), and
    whether its answer continues content already there (the final message's, with `continue_final_message`)."""
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and body.get("add_generation_prompt") is True:
        # vLLM's ChatCompletionRequest.check_generation_prompt, word for word.
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    # Left out, it is false when the final message is continued: the two never go together (above).
    generation_prompt = _flag(body, "add_generation_prompt", not continue_final)
    if continue_final and messages[-1]["role"] != "assistant":
        raise BadRequest("`continue_final_message` needs the last message to be the assistant's", "messages")
    context: list[int] = []
    for message in messages:
        context += [token_id(f"<{message['role']}>"), *map(token_id, words(content_text(message.get("content"))))]
        context.append(token_id(END))
    continued = bool(continue_final and words(content_text(messages[-1].get("content"))))
    if continue_final:
        context.pop()  # the final message stays open
    if generation_prompt:
        context.append(token_id(GENERATION_PROMPT))
    return context, continued
