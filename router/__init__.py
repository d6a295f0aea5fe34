"""Router: the OpenAI-compatible ASGI app in front of ready replicas, and API keys."""
