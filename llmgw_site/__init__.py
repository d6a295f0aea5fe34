"""llmgw: run LLM inference engines on a GPU fleet behind one OpenAI endpoint."""

from llmgw_site.celery import app as celery_app

__all__ = ["celery_app"]
