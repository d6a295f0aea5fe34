"""Token prices: what a million prompt (input) and completion (output) tokens of a model or adapter cost, and
what one request's tokens cost at those prices.

Prices are in the organisation's own currency unit (operators of a private fleet set internal prices; 0 is
free) and are Decimals end to end: spend is summed over many requests, and binary floats would drift.
"""

from dataclasses import dataclass
from decimal import Context, Decimal, Inexact, InvalidOperation, Overflow, localcontext

TOKENS_PER_PRICE = 1_000_000
"""A price is for this many tokens."""

# The stored precision of a price: up to 99,999,999.999999 per million tokens (14 digits, so any price
# written as a number in a YAML catalog file reads back exactly: a double holds 15).
PRICE_MAX_DIGITS = 14
PRICE_DECIMAL_PLACES = 6

# Wide enough for any token count times any stored price, and trapping Inexact: a cost is never rounded.
_EXACT = Context(prec=60, traps=[Inexact, InvalidOperation, Overflow])


def cost(prompt_tokens: int, completion_tokens: int, price_in: Decimal, price_out: Decimal) -> Decimal:
    """What `prompt_tokens` and `completion_tokens` cost at `price_in` and `price_out` per million, exactly.

    Not rounded to a currency's cents: a request of a few tokens costs a fraction of one, and spend is the sum.
    """
    for name, tokens in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"{name} must be a whole number of tokens, 0 or more, not {tokens!r}")
    for name, price in (("price_in", price_in), ("price_out", price_out)):
        if not isinstance(price, Decimal) or not price.is_finite() or price < 0:
            raise ValueError(f"{name} must be a Decimal price, 0 or more, not {price!r}")
    with localcontext(_EXACT):
        return (prompt_tokens * price_in + completion_tokens * price_out) / TOKENS_PER_PRICE


def price_text(price: Decimal) -> str:
    """A price as plain decimal text without trailing zeros: 0.15 (stored as 0.150000), 100 (not 1E+2), 0."""
    return f"{price.normalize():f}"


@dataclass(frozen=True)
class Prices:
    """The price of a million prompt tokens and of a million completion tokens (0 = free)."""

    input_per_million: Decimal
    output_per_million: Decimal

    def cost(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        """What one request's tokens cost at these prices (`cost`)."""
        return cost(prompt_tokens, completion_tokens, self.input_per_million, self.output_per_million)


def inherited(own_input: Decimal | None, own_output: Decimal | None, base: Prices) -> Prices:
    """An adapter's prices: each one it sets, else its base model's (an adapter may price only its output)."""
    return Prices(
        base.input_per_million if own_input is None else own_input,
        base.output_per_million if own_output is None else own_output,
    )
