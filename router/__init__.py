"""Router: the OpenAI-compatible ASGI app in front of ready replicas (the data plane; API keys live in `keys`)."""
