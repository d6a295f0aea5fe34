"""Control-plane ASGI app: Django over HTTP, the agent consumer over WebSocket, and the probes in front
(llmgw_site.probes)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from agentlink.consumers import AgentConsumer  # noqa: E402
from hub.gc_tuning import tune_gc  # noqa: E402
from llmgw_site.probes import Probes, quiet_probes  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": Probes(django_asgi_app),
        "websocket": URLRouter([path("agent/ws", AgentConsumer.as_asgi())]),
    }
)

quiet_probes()
# A thousand agent streams make a big heap: full collections with the default thresholds stall command relay.
tune_gc()
