"""Dashboard: the operators' view (cluster summary, ctl_status, /admin index)."""
