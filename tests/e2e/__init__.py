"""End-to-end tests: the real processes (`up`, agents, engines, routers) started as an operator starts them."""
