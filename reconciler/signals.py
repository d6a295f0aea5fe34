"""Signals the reconciler sends; whoever runs ticks may listen (the embedded runner ticks at once)."""

from django.dispatch import Signal

# Sent after a commit that left work for the next tick (a replica became ready or failed,
# a start is due again), so a listener can tick now instead of at the next interval.
work_pending = Signal()
