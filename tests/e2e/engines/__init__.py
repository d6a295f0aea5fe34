"""End-to-end tests of real engines: vLLM's CPU build, llama.cpp's server, and the environment agents give them."""
