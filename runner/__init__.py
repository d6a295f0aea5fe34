"""The embedded runner: `manage.py up [--demo]` runs the control plane, the router, the
reconcile ticker (and, with --demo, simulated nodes' agents) in one process.

It sits at the top of the dependency stack and owns nothing durable.
"""
