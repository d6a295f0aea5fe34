"""What the router counts and reports: usage read from answers, requests and tokens per key and model, rate limits, and their flush to the hub."""
