"""Every setting llmgw reads from the environment, in one registry: name, type, default and meaning.

`settings.py` reads each one through `setting(NAME)`, which picks the strict
`env_*` reader for its type (a bad value stops start-up naming the variable),
and `manage.py settings_table` prints the Configuration table of docs/configuration.md from
the same entries, so the documentation cannot drift from what is read (a test
compares them, and checks settings.py reads nothing around the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw_site.env import env_bool, env_float, env_int, env_list, env_port, env_port_range, env_str


@dataclass(frozen=True)
class Setting:
    """One environment variable: its reader type, default, meaning, and how docs/configuration.md shows the default."""

    name: str
    kind: str  # str, bool, float, int, port, port_range, list
    default: Any
    help: str
    minimum: float | None = None
    shown_default: str | None = None  # when the default is computed at start-up


def _s(name, kind, default, help, minimum=None, shown=None) -> Setting:
    return Setting(name, kind, default, help, minimum, shown)


SETTINGS: tuple[Setting, ...] = (
    _s("DATABASE_URL", "str", None, "database (PostgreSQL for a fleet)", shown="SQLite at `$LLMGW_HOME/llmgw.sqlite3`"),
    _s("REDIS_URL", "str", None, "channel layer, endpoint list, usage, activations, Celery broker; unset = embedded"),
    _s(
        "SECRET_KEY",
        "str",
        None,
        "required with `DATABASE_URL`",
        shown="random, kept in `$LLMGW_HOME` without `DATABASE_URL`",
    ),
    _s("DEBUG", "bool", False, "Django debug mode"),
    _s(
        "LLMGW_HOME",
        "str",
        None,
        "where llmgw keeps its state: the SQLite file and secret key of embedded mode, the demo's credentials",
        shown="`var/` in a source checkout, else the user's data folder (`~/.local/share/llmgw`)",
    ),
    _s("LLMGW_VAR_DIR", "str", None, "the old name of `LLMGW_HOME`: set, it stops the start, naming the new one"),
    _s("LLMGW_HOST", "str", "127.0.0.1", "where `up` listens (`--host`); also an allowed `Host` header"),
    _s(
        "ALLOWED_HOSTS",
        "list",
        None,
        "Django's, comma-separated; replaces the default list; `up --host` refuses a host not allowed",
        shown="`127.0.0.1,localhost,[::1]` and `LLMGW_HOST`",
    ),
    _s(
        "LLMGW_ALLOWED_HOSTS",
        "list",
        [],
        "comma-separated hosts added to `ALLOWED_HOSTS` (e.g. `llmgw.example.com,.internal`) behind a load balancer",
    ),
    _s("CSRF_TRUSTED_ORIGINS", "list", [], "Django's, comma-separated origins (`https://llmgw.example.com`)"),
    _s("LLMGW_CSRF_TRUSTED_ORIGINS", "list", [], "comma-separated origins added to `CSRF_TRUSTED_ORIGINS`"),
    _s(
        "LLMGW_METRICS_TOKEN",
        "str",
        "",
        "when set, both `/metrics` (control plane and router) need `Authorization: Bearer <token>` (401 otherwise)",
    ),
    _s("STATIC_ROOT", "str", None, "Django's; static files are served by the app, `collectstatic` is optional"),
    _s("LOG_LEVEL", "str", "INFO", "root log level"),
    _s("LLMGW_PORT", "port", 8000, "control-plane port of `up` (`--port`)"),
    _s("LLMGW_ROUTER_PORT", "port", 8080, "router port of `up` (`--router-port`)"),
    _s("LLMGW_TICK_SECONDS", "float", 2.0, "reconcile interval (beat schedule too)", 0.1),
    _s(
        "LLMGW_LEASE_TTL_SECONDS",
        "float",
        15.0,
        "leader lease lifetime (renewed every tick, or every third of it when shorter)",
        1.0,
    ),
    _s("LLMGW_HEARTBEAT_SECONDS", "float", 5.0, "agent heartbeat interval (embedded agents)", 0.1),
    _s(
        "LLMGW_LLAMA_SERVER",
        "str",
        "llama-server",
        "llama.cpp server binary agents start, a name on PATH or a path (`manage.py build_llama_server` prints one)",
    ),
    _s(
        "LLMGW_VLLM_COMMAND",
        "str",
        "",
        "what agents run to start vLLM's OpenAI server, split as a shell would: `vllm serve`, or "
        "`/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server` (see [A real vLLM](engines.md#a-real-vllm-on-a-laptop))",
        shown="the CPU build `make vllm` cached, else `vllm serve`",
    ),
    _s("LLMGW_UNREACHABLE_AFTER_SECONDS", "float", 20.0, "a node silent this long is unreachable", 1.0),
    _s("LLMGW_LOST_AFTER_SECONDS", "float", 120.0, "a node silent this long is lost (not below the above)", 1.0),
    _s("LLMGW_GPU_QUARANTINE_SECONDS", "float", 300.0, "a recovered GPU waits this long before reuse", 0.0),
    _s(
        "LLMGW_START_RESEND_SECONDS",
        "float",
        10.0,
        "a start the agent acknowledged but never answered with a status is sent again after this",
        0.5,
    ),
    _s(
        "LLMGW_COMMAND_RESEND_SECONDS",
        "float",
        1.0,
        "a command the agent has not acknowledged is sent again after about this long (doubling, up to 8 times)",
        0.1,
    ),
    _s("LLMGW_COMMAND_RESEND_BATCH", "int", 200, "most unacknowledged commands one tick sends again", 1),
    _s(
        "LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS",
        "float",
        86400.0,
        "weights a node holds that no profile uses are removed once unused this long (from the first sweep that "
        "found them unused)",
        0.0,
    ),
    _s("LLMGW_WEIGHTS_SWEEP_SECONDS", "float", 600.0, "the leader sweeps the nodes' unused weights this often", 1.0),
    _s("LLMGW_WEIGHTS_SWEEP_BATCH", "int", 100, "most weights removals one sweep sends", 1),
    _s(
        "LLMGW_STAGE_ENGINES",
        "list",
        ["vllm", "sglang"],
        "comma-separated engines whose hub weights are staged: a replica whose weights are on none of its nodes "
        "waits for its agents to fetch them (holding no GPU) before its engine starts; empty: engines download "
        "them themselves",
    ),
    _s(
        "LLMGW_STAGE_PEER_COPIES",
        "int",
        2,
        "most stages one node's weights server feeds at once; past it, a stage waits for a peer rather than ask the "
        "hub for weights the fleet holds",
        1,
    ),
    _s(
        "LLMGW_STAGE_STALL_SECONDS",
        "float",
        60.0,
        "a stage its agent has not reported on for this long is asked for again (the agent resumes it)",
        1.0,
    ),
    _s(
        "LLMGW_CHANNEL_CAPACITY",
        "int",
        10000,
        "messages that may wait for one control-plane process (all its agent streams share one Redis queue); "
        "beyond, a command is refused to its sender and stays pending",
        1,
    ),
    _s(
        "LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS",
        "int",
        300,
        "an agent stream leaves its node's group unless a heartbeat renews it within this (keep it above the "
        "heartbeat interval)",
        10,
    ),
    _s("LLMGW_REDIS_POOL_SIZE", "int", 100, "channel-layer Redis connections per control-plane process", 2),
    _s(
        "LLMGW_REDIS_POOL_TIMEOUT_SECONDS",
        "float",
        10.0,
        "how long a channel-layer call waits for a free Redis connection before it fails",
        0.0,
    ),
    _s(
        "LLMGW_LAST_SEEN_FLUSH_SECONDS",
        "float",
        1.0,
        "heartbeats' `last_seen` is written for all nodes at once this often (0: at each heartbeat)",
        0.0,
    ),
    _s(
        "LLMGW_HEARTBEAT_RECHECK_SECONDS",
        "float",
        30.0,
        "a heartbeat the same as the node's last one, from a node running no shard, is checked against the "
        "tables only this often",
        0.0,
    ),
    _s("LLMGW_SHARD_START_TIMEOUT_SECONDS", "float", 900.0, "a shard not ready by then fails its replica", 1.0),
    _s("LLMGW_BACKOFF_BASE_SECONDS", "float", 5.0, "retry backoff for failed replicas: first delay", 0.0),
    _s("LLMGW_BACKOFF_MAX_SECONDS", "float", 300.0, "retry backoff for failed replicas: longest delay", 0.0),
    _s("LLMGW_BACKOFF_RESET_SECONDS", "float", 120.0, "a replica ready this long has its failure count reset", 0.0),
    _s("LLMGW_ENGINE_PORT_RANGE", "port_range", (20000, 29999), "ports given to engines"),
    _s(
        "LLMGW_BUSY_PORT_SECONDS",
        "float",
        600.0,
        "a port an agent found taken is not given to that host for this long",
        0.0,
    ),
    _s(
        "LLMGW_ACTIVATION_TIMEOUT_SECONDS",
        "float",
        120.0,
        "how long the router holds a request for a starting model",
        0.0,
    ),
    _s("LLMGW_ROUTER_POLL_SECONDS", "float", 5.0, "routers re-read the endpoint list this often besides the push", 0.1),
    _s("LLMGW_USAGE_FLUSH_SECONDS", "float", 1.0, "routers write last-use stamps and in-flight peaks this often", 0.05),
    _s(
        "LLMGW_UPSTREAM_CONNECT_SECONDS",
        "float",
        5.0,
        "router deadline for connecting to an engine (then another replica is tried)",
        0.001,
    ),
    _s(
        "LLMGW_UPSTREAM_FIRST_BYTE_SECONDS",
        "float",
        600.0,
        "router deadline for an engine's first byte, from sending (connecting included; then 504)",
        0.001,
    ),
    _s(
        "LLMGW_UPSTREAM_IDLE_SECONDS",
        "float",
        120.0,
        "silence allowed between chunks of a stream (then it ends with an error event)",
        0.001,
    ),
    _s(
        "LLMGW_MAX_WAITERS_PER_MODEL",
        "int",
        1000,
        "requests a router holds for one starting model; beyond, 503 with `Retry-After`",
        1,
    ),
    _s(
        "LLMGW_QUEUE_MAX_WAITING",
        "int",
        1000,
        "requests one team (or key of no team) may have waiting in a router for a model at capacity (its profiles' "
        "max concurrency); beyond, 429 with `Retry-After`",
        1,
    ),
    _s(
        "LLMGW_QUEUE_MAX_WAIT_SECONDS",
        "float",
        120.0,
        "how long a request waits in a router for a model at capacity before a 503 naming its wait",
        0.001,
    ),
    _s(
        "LLMGW_STREAM_MIGRATIONS",
        "int",
        2,
        "continuations of one stream on another replica, in a row, that may bring no token before the router gives "
        "it up (a leg that brings one starts the count again); a whole answer is asked again this many times at "
        "most (0: never either)",
        0,
    ),
    _s(
        "LLMGW_BUDGET_RESERVATION_SECONDS",
        "float",
        3600.0,
        "how long a budget's reservation outlives a router that died holding it, before it is charged at what it "
        "reserved (longer than any answer: one still running then is charged so too)",
        1.0,
    ),
    _s(
        "LLMGW_BUDGET_OUTPUT_TOKENS",
        "int",
        32768,
        "the answer a budget's reservation counts on when the request sets no `max_tokens` and no profile of the "
        "model sets `max_model_len`",
        1,
    ),
    _s(
        "LLMGW_REQUEST_RECORD_DAYS",
        "int",
        0,
        "days a record of each request (key, model, status, tokens, spend, duration) is kept, beside the hourly "
        "usage; 0 = no per-request records",
        0,
    ),
    _s(
        "LLMGW_SHUTDOWN_GRACE_SECONDS",
        "float",
        30.0,
        "on SIGTERM a router refuses new requests and lets streams finish this long",
        0.0,
    ),
    _s(
        "LLMGW_PARTITION_BRAKE_FRACTION",
        "float",
        0.3,
        "more than this share of nodes silent together (and more than one): declare none lost",
        0.0,
    ),
    _s("LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS", "float", 1800.0, "idle timeout of a profile that sets none", 1.0),
    _s("LLMGW_EVICT_MIN_IDLE_SECONDS", "float", 60.0, "eviction takes only replicas idle at least this long", 0.0),
    _s("LLMGW_MIN_RESIDENCY_SECONDS", "float", 300.0, "eviction takes only replicas ready at least this long", 0.0),
    _s(
        "LLMGW_MAX_SWAP_WAIT_SECONDS",
        "float",
        60.0,
        "a sleeping model or a cold start waiting this long for GPUs may have occupants still in use drained for it "
        "(never cut)",
        0.0,
    ),
    _s(
        "LLMGW_HOST_MEMORY_SLEEP_FRACTION",
        "float",
        0.5,
        "share of a node's host memory level-1 sleepers may hold (their weights); beyond, they sleep at level 2",
        0.0,
    ),
    _s(
        "LLMGW_SCALE_OUT_AFTER_SECONDS",
        "float",
        30.0,
        "load above target concurrency (or latency over the objectives) must last this long to add replicas",
        0.0,
    ),
    _s(
        "LLMGW_LATENCY_WINDOW_SECONDS",
        "float",
        60.0,
        "the window of time to first token, gaps between tokens and queue waits each router reports, which objective "
        "scaling and the operators' view read",
        1.0,
    ),
    _s(
        "LLMGW_OBJECTIVE_SCALE_UP",
        "float",
        0.9,
        "a profile with objectives is over them once its worst p90 over its objective (replicas still starting "
        "discounted) reaches this",
        0.01,
    ),
    _s(
        "LLMGW_OBJECTIVE_SCALE_DOWN",
        "float",
        0.7,
        "and is over them until that falls to this (below LLMGW_OBJECTIVE_SCALE_UP: the gap is the hysteresis)",
        0.0,
    ),
    _s(
        "LLMGW_ACTIVATION_LINGER_SECONDS",
        "float",
        10.0,
        "an unplaced replica nobody has asked for this long is withdrawn",
        1.0,
    ),
    _s(
        "LLMGW_UNPUBLISH_GRACE_SECONDS",
        "float",
        0.5,
        "a replica taken out of service is unpublished this long before its engine is drained or put to sleep",
        0.1,
    ),
    _s(
        "LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS",
        "float",
        300.0,
        "a LoRA adapter load (or unload) not answered this long is forgotten, and asked for again if still wanted",
        1.0,
    ),
    _s(
        "LLMGW_DRAIN_TIMEOUT_SECONDS",
        "float",
        300.0,
        "a draining engine is stopped after this long even with requests running",
        0.0,
    ),
    _s(
        "LLMGW_ROUTER_FORGET_SECONDS",
        "float",
        300.0,
        "a router silent this long is presumed gone (until then idleness is unknown)",
        1.0,
    ),
    _s("LLMGW_ENGINE_POLL_SECONDS", "float", 1.0, "each router reads each replica's `/metrics` this often", 0.1),
    _s("LLMGW_KV_CACHE_FULL_FRACTION", "float", 0.95, "routers skip replicas whose KV cache is fuller than this", 0.0),
    _s(
        "LLMGW_PREFIX_AFFINITY_SLACK",
        "int",
        4,
        "a shared prompt prefix sticks to a replica while it has at most this many more in flight",
        0,
    ),
    _s(
        "LLMGW_TLS_CERT_FILE",
        "str",
        "",
        "PEM certificate (chain) `up` serves the control plane with: https:// and wss://",
    ),
    _s("LLMGW_TLS_KEY_FILE", "str", "", "private key of `LLMGW_TLS_CERT_FILE` (unset: it is in that file)"),
    _s(
        "LLMGW_TLS_CLIENT_CA_FILE",
        "str",
        "",
        "mutual TLS: an agent must present a certificate from this CA whose CN is its node's name",
    ),
    _s(
        "LLMGW_AGENT_CONTROL_PLANES",
        "list",
        [],
        "comma-separated `/agent/ws` URLs `enrol_node --print-command` gives agents",
    ),
    _s(
        "LLMGW_AGENT_CA_FILE",
        "str",
        "",
        "CA bundle path on the nodes that `enrol_node --print-command` passes as `--ca-file`",
    ),
    _s(
        "LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS",
        "float",
        600.0,
        "a node drain waits this long for a replica's replacement to be ready before draining it anyway",
        0.0,
    ),
)
REGISTRY: dict[str, Setting] = {s.name: s for s in SETTINGS}

_UNSET: Any = object()


def setting(name: str, default: Any = _UNSET) -> Any:
    """The value of registered setting `name` from the environment, read by the strict reader of its type.

    `default` overrides the registry's only where the default is computed at
    start-up (such entries show it in `shown_default`).
    """
    entry = REGISTRY[name]  # KeyError: every variable read must be registered (and so documented)
    value = entry.default if default is _UNSET else default
    if entry.kind == "str":
        return env_str(name, value)
    if entry.kind == "bool":
        return env_bool(name, value)
    if entry.kind == "float":
        return env_float(name, value, minimum=entry.minimum)
    if entry.kind == "int":
        return env_int(name, value, minimum=None if entry.minimum is None else int(entry.minimum))
    if entry.kind == "port":
        return env_port(name, value)
    if entry.kind == "port_range":
        return env_port_range(name, value)
    if entry.kind == "list":
        return env_list(name, value)
    raise ValueError(f"{name}: unknown setting kind {entry.kind!r}")


def shown_default(entry: Setting) -> str:
    """The default as docs/configuration.md shows it."""
    if entry.shown_default is not None:
        return entry.shown_default
    value = entry.default
    if value is None or value == "" or value == []:
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, tuple):
        return f"`{value[0]}-{value[1]}`"
    return f"`{value}`"


def markdown_table() -> str:
    """The Configuration table of docs/configuration.md, one row per registered setting."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{e.name}` | {shown_default(e)} | {e.help} |" for e in SETTINGS]
    return "\n".join(lines) + "\n"
