"""The what-if planner: would these models fit the fleet now, and what would have to stop."""
