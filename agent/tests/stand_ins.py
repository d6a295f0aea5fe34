"""Shared by the agent's command-line tests: a control plane served from a thread, and bad command lines."""

import json
import queue
import threading

from websockets.sync.server import serve


class ThreadedControlPlane:
    """A stand-in /agent/ws served from a thread, for commands that run their own event loop."""

    def __init__(self, reject_status: int | None = None):
        self.reject_status = reject_status
        self.messages: queue.Queue = queue.Queue()

    def __enter__(self):
        self.server = serve(self._handler, "127.0.0.1", 0, process_request=self._process_request)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/agent/ws"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(5)

    def _process_request(self, connection, request):
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    def _handler(self, ws):
        try:
            for raw in ws:
                self.messages.put(json.loads(raw))
        except Exception:
            pass


CP = "ws://127.0.0.1:9/agent/ws"


# Bad command lines and what the refusal must name; `manage.py agent` and `python -m agent` say the same.
BAD_ARGUMENTS = [
    (["--node", "n1", "--token", "t"], "at least one --control-plane"),
    (["--control-plane", "http://cp/agent/ws", "--node", "n1", "--token", "t"], "must be a ws:// or wss:// URL"),
    (["--control-plane", CP, "--node", "bad name!", "--token", "t"], "Node name 'bad name!'"),
    (["--control-plane", CP, "--node", "n1"], "--token or the LLMGW_NODE_TOKEN"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--label", "rack"], "Label 'rack' is not key=value"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--fake-gpus", "8xH100"], "Cannot discover GPUs"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--heartbeat-seconds", "0"], "must be positive"),
]
