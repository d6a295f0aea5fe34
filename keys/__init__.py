"""API keys (control plane): the keys clients send to the routers, their scopes and limits, their token usage,
the admin and command that issue them, and the pushes that tell every router of a change."""
