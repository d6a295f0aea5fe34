"""Answers whose engine broke off, counted in memory per model between usage flushes: what became of them and the
prompt tokens engines re-read to continue them (the hub's `ContinuationCount`).

router.forwarding.resume and proxy count here beside `llmgw_router_stream_continuations_total` and
`llmgw_router_continuation_prompt_tokens_total`, so the control plane shows the same figures per hour; the usage
flusher (router.accounting.flusher) takes the counts with the tokens. Only a break calls it: an answer that ends
whole costs nothing here, and nothing here does I/O.
"""

from __future__ import annotations

from hub.contracts import ContinuationCount, ContinuationCounts

# Positions in a model's row, in ContinuationCount's field order.
CONTINUED, FAILED, REFUSED, REPROCESSED = range(4)

KIND_OF_OUTCOME = {
    "continued": CONTINUED,
    "resent_whole": CONTINUED,
    "finished": CONTINUED,  # the client had the finish reason: only the end of the stream was missing
    "no_replica": FAILED,
    "limit": FAILED,
}
"""The metric's outcomes (router.forwarding.continuation's constants, and resume.FINISHED) by what the client got.
Any other outcome is a reason `continuation.refusal` gave not to continue: REFUSED. Spelled out rather than
imported, as forwarding is above accounting; router/tests/accounting/test_continuation_counts.py holds them to the
constants."""


class ContinuationCounter:
    """Broken answers per public model since the last flush: continued, failed, refused, prompt tokens re-read.

    Used only on the router's event loop (the proxy counts, the flusher takes), so it needs no lock.
    """

    def __init__(self) -> None:
        # model -> [continued, failed, refused, reprocessed]: list items, as TokenCounter keeps them.
        self._counts: dict[str, list[int]] = {}

    def _row(self, model: str) -> list[int]:
        row = self._counts.get(model)
        if row is None:
            row = self._counts[model] = [0, 0, 0, 0]
        return row

    def count(self, model: str, outcome: str) -> None:
        """One break of an answer of `model`, with the metric's `outcome` label."""
        self._row(model)[KIND_OF_OUTCOME.get(outcome, REFUSED)] += 1

    def reprocessed(self, model: str, tokens: int) -> None:
        """`tokens` prompt tokens an engine read again to continue an answer of `model` (0: nothing counted)."""
        if tokens:
            self._row(model)[REPROCESSED] += tokens

    def take(self) -> ContinuationCounts:
        """Swap out the counts gathered since the last take."""
        counts, self._counts = self._counts, {}
        return _typed(counts)

    def restore(self, counts: ContinuationCounts) -> None:
        """Put back what a flush could not deliver: counts add up."""
        for model, count in counts.items():
            row = self._row(model)
            for i, amount in enumerate((count.continued, count.failed, count.refused, count.reprocessed)):
                row[i] += amount

    def pending(self) -> ContinuationCounts:
        """A copy of what the next flush would take (for tests)."""
        return _typed(self._counts)


def _typed(counts: dict[str, list[int]]) -> ContinuationCounts:
    """The counter's rows as the hub's contract has them (new objects: later counting never changes them)."""
    return {
        model: ContinuationCount(continued=row[0], failed=row[1], refused=row[2], reprocessed=row[3])
        for model, row in counts.items()
    }
