"""Leadership of the control plane: the lease row and a Celery worker's campaign for it."""
