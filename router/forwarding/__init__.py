"""Forwarding one request: its body, the headers both ways, the relay to an engine, its deadlines, its hold for a cold start, and its trace."""
