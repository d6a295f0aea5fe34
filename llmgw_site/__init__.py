"""llmgw: run LLM inference engines on a GPU fleet behind one OpenAI endpoint.

`celery_app` is the Celery app of distributed mode (`llmgw_site.celery`),
imported on first use; `celery -A llmgw_site` finds it there.
"""

from typing import Any

__all__ = ["celery_app"]


def __getattr__(name: str) -> Any:
    # Not imported with the package, as Celery's Django recipe has it: Celery is a tenth of a second of
    # start-up that every web process and `manage.py` command would pay without sending a task. The task
    # module imports the app itself (reconciler.tasks), so no task is ever bound to Celery's default app.
    if name == "celery_app":
        from .celery import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
