"""Teams: who shares a fleet, which models each may use, and who manages their keys."""
