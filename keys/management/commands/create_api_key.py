"""`manage.py create_api_key NAME [...]`: issue (or import) a router API key with its scopes and limits; print it once."""

import datetime as dt
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from hub.credentials import hash_secret
from keys.models import ApiKey
from keys.scopes import parse_names, unknown_models, unknown_models_message

# An imported key shorter than this is too easy to guess to stand for a team.
MIN_IMPORTED_KEY_LENGTH = 20


def positive_int(value: str) -> int:
    """argparse type for --rpm/--tpm."""
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise ValueError(f"{value} is not a positive number")
    return number


def parse_expiry(value: str, now: dt.datetime) -> dt.datetime:
    """`2027-01-01` (midnight, server time zone) or an ISO date-time; must be in the future."""
    try:
        when: dt.datetime | None = parse_datetime(value)
        day: dt.date | None = parse_date(value) if when is None else None
    except ValueError as exc:  # well formed but not a real date: 2027-02-30
        raise CommandError(f"--expires {value!r}: {exc}") from None
    if day is not None:
        when = dt.datetime.combine(day, dt.time())
    if when is None:
        raise CommandError(f"--expires {value!r}: expected a date (2027-01-01) or a date-time (2027-01-01T12:00Z)")
    if timezone.is_naive(when):
        when = timezone.make_aware(when)
    if when <= now:
        raise CommandError(f"--expires {value!r}: that is in the past; give a future date")
    return when


class Command(BaseCommand):
    """Thin over ApiKey.issue: check the arguments against the catalog, issue the key, print it once."""

    help = (
        "Create an API key for the router and print it once on stdout (only its hash is stored). "
        "--key imports an existing secret, e.g. when moving from another gateway."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("name", help="Who or what the key is for, e.g. a team or a service.")
        parser.add_argument(
            "--key",
            help=f"Import this secret instead of generating one (at least {MIN_IMPORTED_KEY_LENGTH} characters).",
        )
        parser.add_argument("--models", default="", help="Comma-separated models or aliases it may use (default: all).")
        parser.add_argument(
            "--pools", default="", help="Comma-separated pools whose replicas may serve it (default: any)."
        )
        parser.add_argument("--expires", help="Refuse it from this date (2027-01-01) or date-time on (default: never).")
        parser.add_argument("--rpm", help="Requests per minute (default: no limit).")
        parser.add_argument("--tpm", help="Tokens per minute (default: no limit).")

    def handle(
        self,
        *args: Any,
        name: str,
        key: str | None,
        models: str,
        pools: str,
        expires: str | None,
        rpm: str | None,
        tpm: str | None,
        **options: Any,
    ) -> None:
        name = name.strip()
        if not name:
            raise CommandError("the key name must not be empty")
        max_length = ApiKey._meta.get_field("name").max_length
        if max_length is not None and len(name) > max_length:
            raise CommandError(f"the key name is {len(name)} characters long; at most {max_length} are allowed")
        fields = {
            "allowed_models": self._models(models),
            "allowed_pools": parse_names(pools),
            "expires_at": None if expires is None else parse_expiry(expires, timezone.now()),
            "rpm": self._limit("--rpm", rpm),
            "tpm": self._limit("--tpm", tpm),
        }
        if key is not None:
            self._check_imported(key)
        api_key, plaintext = ApiKey.issue(name, key, **fields)
        # The key alone on stdout, so `KEY=$(manage.py create_api_key x)` captures exactly it.
        self.stdout.write(plaintext)
        verb = "Imported" if key is not None else "Created"
        self.stderr.write(
            self.style.WARNING(f"{verb} API key “{api_key.name}” ({api_key.prefix}…). It will not be shown again.")
        )

    def _models(self, text: str) -> list[str]:
        names = parse_names(text)
        unknown = unknown_models(names)
        if unknown:
            raise CommandError(f"--models: {unknown_models_message(unknown)}")
        return names

    def _limit(self, option: str, value: str | None) -> int | None:
        if value is None:
            return None
        try:
            return positive_int(value)
        except ValueError as exc:
            raise CommandError(f"{option}: {exc}") from None

    def _check_imported(self, key: str) -> None:
        if key != key.strip() or any(c.isspace() for c in key):
            raise CommandError("--key: the key must not contain spaces")
        if len(key) < MIN_IMPORTED_KEY_LENGTH:
            raise CommandError(
                f"--key: the key is {len(key)} characters long; at least {MIN_IMPORTED_KEY_LENGTH} are required"
            )
        if ApiKey.objects.filter(key_hash=hash_secret(key)).exists():
            raise CommandError("--key: this key is already stored (under some name); it was not imported again")
