"""The fault drill: the distributed stack on private PostgreSQL and Redis, load, faults, a verdict table."""
