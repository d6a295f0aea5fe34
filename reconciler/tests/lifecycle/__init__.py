"""Tests of replicas' state changes, liveness, drains and failures."""
