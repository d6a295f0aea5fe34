"""The weights this node holds: what a scan finds and reports to the control plane."""
