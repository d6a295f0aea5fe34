"""Tests of the operators' commands: ctl_status, plan and the others."""
