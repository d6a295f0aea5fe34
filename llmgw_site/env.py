"""Strict readers for settings taken from the environment.

A bad value fails at start-up with ImproperlyConfigured naming the variable,
rather than surfacing later as a confusing runtime error.
"""

import math
import os

from django.core.exceptions import ImproperlyConfigured

from nodewire.protocol import parse_port

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None else value


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_float(name: str, default: float, minimum: float | None = None) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if number != number or (minimum is not None and number < minimum):
        raise ImproperlyConfigured(f"{name}={value!r} must be a number of at least {minimum}")
    if math.isinf(number):  # a duration of inf seconds overflows every timedelta made of it
        raise ImproperlyConfigured(f"{name}={value!r} must be a finite number")
    return number


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={value!r} must be a whole number of at least {minimum}")
    return number


def env_port(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return parse_port(value.strip())
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None


def env_port_range(name: str, default: tuple[int, int]) -> tuple[int, int]:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    low_text, sep, high_text = value.partition("-")
    try:
        if not sep:
            raise ValueError
        low, high = parse_port(low_text.strip()), parse_port(high_text.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a port range like 20000-29999") from None
    if not (1024 <= low <= high):
        raise ImproperlyConfigured(f"{name}={value!r} must satisfy 1024 <= low <= high <= 65535")
    return low, high


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    """A comma-separated list, items stripped and empty ones dropped (`a, b,` is `["a", "b"]`)."""
    value = os.environ.get(name)
    if value is None:
        return list(default or [])
    return [item.strip() for item in value.split(",") if item.strip()]
