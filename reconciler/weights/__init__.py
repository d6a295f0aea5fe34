"""Weights on nodes' disks as the leader keeps them: removal after deletes and the sweep of unused ones."""
