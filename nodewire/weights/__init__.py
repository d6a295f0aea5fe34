"""Model weights on a node's disk, as the agent and the control plane both see them: where they live, what their headers say, and how they are reported."""
