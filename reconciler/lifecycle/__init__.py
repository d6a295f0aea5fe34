"""A replica's life: its state changes, node liveness, drains and GPU faults."""
