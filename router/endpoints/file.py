"""The file form of router-only mode (`manage.py router --endpoints FILE`): models, their engines and aliases.

    models:
      llama-3.1-8b-instruct:
        aliases: [llama3]
        endpoints:
          - url: http://10.0.0.5:8000
            api_key_env: LLAMA_A_KEY      # the engine's --api-key, read from this environment variable
          - url: http://10.0.0.6:8000
            api_key: sk-engine-b          # or given literally (the file is then a secret)
            weight: 2                     # optional, as a fleet replica's: weight (>= 1), priority, pool
          - http://10.0.0.7:8000          # a bare URL: an endpoint with no key and the defaults
        streams: token_ids                # a broken stream goes on elsewhere: by token ids (vLLM engines only),
                                          # from its text (the default: `text`), or not at all (`off`)

Everything is checked before the router starts; an error names its place in
the file (`models.llama.endpoints[1].url: …`), and unknown keys are refused.
A key comes only from here, never from the command line, so it never shows
in `ps`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from router.endpoints.static import STREAM_WAYS, EndpointSpec, EndpointSpecError, StaticTableSpec, http_url_problem

MODEL_KEYS = {"aliases", "endpoints", "streams"}
ENDPOINT_KEYS = {"url", "api_key", "api_key_env", "weight", "priority", "pool"}
# What an Authorization header can carry as it is: visible ASCII (hub.contracts.UpstreamKey).
_HEADER_SAFE = re.compile(r"[!-~]+")


def load_endpoints_file(path: str | Path, environ: Mapping[str, str] = os.environ) -> StaticTableSpec:
    """The spec in the endpoints file at `path` (keys named by `api_key_env` read from `environ`), or an
    EndpointSpecError naming the file and the place in it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EndpointSpecError(f"--endpoints {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EndpointSpecError(f"--endpoints {path}: not YAML ({exc})") from None
    try:
        return parse_endpoints_document(document, environ)
    except EndpointSpecError as exc:
        raise EndpointSpecError(f"--endpoints {path}: {exc}") from None


def parse_endpoints_document(document: Any, environ: Mapping[str, str]) -> StaticTableSpec:
    """The spec of an endpoints file's parsed YAML; EndpointSpecError naming the path in the document."""
    top = _mapping(document, "the file", {"models"})
    if "models" not in top:
        raise EndpointSpecError("models: missing (a mapping of model names to their endpoints)")
    models = _mapping(top["models"], "models", None)
    if not models:
        raise EndpointSpecError("models: no model given")
    spec = StaticTableSpec()
    for name, entry in models.items():
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise EndpointSpecError(f"models: {name!r} is not a model name (a string, no surrounding spaces)")
        spec.extend(_model(name, entry, environ))
    return spec


def _model(name: str, entry: Any, environ: Mapping[str, str]) -> StaticTableSpec:
    where = f"models.{name}"
    fields = _mapping(entry, where, MODEL_KEYS)
    endpoints = fields.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        raise EndpointSpecError(f"{where}.endpoints: expected a list of at least one endpoint")
    spec = StaticTableSpec(
        [_endpoint(name, each, f"{where}.endpoints[{i}]", environ) for i, each in enumerate(endpoints)]
    )
    aliases = fields.get("aliases", [])
    if not isinstance(aliases, list):
        raise EndpointSpecError(f"{where}.aliases: expected a list of names")
    for i, alias in enumerate(aliases):
        if not isinstance(alias, str) or not alias.strip():
            raise EndpointSpecError(f"{where}.aliases[{i}]: {alias!r} is not a name")
        spec.aliases.append((alias.strip(), name, f"{where}.aliases[{i}]"))
    if "streams" in fields:
        if fields["streams"] not in STREAM_WAYS:
            raise EndpointSpecError(f"{where}.streams: {fields['streams']!r} is not one of {', '.join(STREAM_WAYS)}")
        spec.streams[name] = fields["streams"]
    return spec


def _endpoint(model: str, entry: Any, where: str, environ: Mapping[str, str]) -> EndpointSpec:
    fields: dict[Any, Any] = {"url": entry} if isinstance(entry, str) else _mapping(entry, where, ENDPOINT_KEYS)
    url = fields.get("url")
    if not isinstance(url, str):
        raise EndpointSpecError(f"{where}.url: missing (the engine's base URL, e.g. http://10.0.0.5:8000)")
    if problem := http_url_problem(url.strip()):
        raise EndpointSpecError(f"{where}.url: {problem}")
    weight, priority, pool = fields.get("weight", 1), fields.get("priority", 0), fields.get("pool", "default")
    if not _is_int(weight) or weight < 1:
        raise EndpointSpecError(f"{where}.weight: {weight!r} is not a whole number of at least 1")
    if not _is_int(priority):
        raise EndpointSpecError(f"{where}.priority: {priority!r} is not a whole number")
    if not isinstance(pool, str) or not pool.strip():
        raise EndpointSpecError(f"{where}.pool: {pool!r} is not a pool name")
    key = _api_key(fields, where, environ)
    return EndpointSpec(model, url.strip().rstrip("/"), where, key, priority, weight, pool.strip())


def _api_key(fields: Mapping[str, Any], where: str, environ: Mapping[str, str]) -> str | None:
    """The endpoint's engine key: given literally, or read from the environment variable named."""
    if "api_key" in fields and "api_key_env" in fields:
        raise EndpointSpecError(f"{where}: give api_key or api_key_env, not both")
    if "api_key_env" in fields:
        variable = fields["api_key_env"]
        if not isinstance(variable, str) or not variable:
            raise EndpointSpecError(f"{where}.api_key_env: {variable!r} is not an environment variable's name")
        key = environ.get(variable, "")
        if not key:
            raise EndpointSpecError(f"{where}.api_key_env: the environment variable {variable} is not set")
        where = f"{where}.api_key_env ({variable})"
    elif "api_key" in fields:
        key, where = fields["api_key"], f"{where}.api_key"
        if not isinstance(key, str) or not key:
            raise EndpointSpecError(f"{where}: expected the key as a string")
    else:
        return None
    if not _HEADER_SAFE.fullmatch(key):
        # The key itself is never shown: it is a secret.
        raise EndpointSpecError(f"{where}: the key holds spaces or characters outside visible ASCII")
    return key


def _mapping(value: Any, where: str, allowed: set[str] | None) -> dict[Any, Any]:
    """`value` as a mapping whose keys are all in `allowed` (None: any), or an error naming `where`."""
    if not isinstance(value, dict):
        raise EndpointSpecError(f"{where}: expected a mapping, not {type(value).__name__}")
    if allowed is not None and (unknown := sorted(map(str, set(value) - allowed))):
        raise EndpointSpecError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(allowed: {', '.join(sorted(allowed))})"
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
