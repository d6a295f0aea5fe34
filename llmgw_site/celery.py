"""The Celery app that runs reconcile ticks in distributed mode.

Each worker campaigns for the lease and consumes the leader queue only while it
holds it (reconciler.leadership.campaign); beat (RedBeat, see settings) sends the ticks there.
"""

import os

from celery import Celery

from reconciler.leadership.campaign import LeaderQueueStep, LeaseCampaignStep

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.steps["worker"].add(LeaseCampaignStep)
app.steps["consumer"].add(LeaderQueueStep)
app.autodiscover_tasks()
