"""The bundled mock engine: an OpenAI-compatible server, run as its own process (`python -m mockengine`), that imitates vLLM where CPUs cannot."""
