"""`manage.py keys create|revoke|list` (`llmgw keys …`): the router's API keys from the command line."""

from argparse import ArgumentParser
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from keys.changes import set_keys_active
from keys.management.commands import create_api_key
from keys.models import ApiKey


class Command(BaseCommand):
    """create: as `create_api_key`; revoke: by the key's printed prefix; list: every key, newest last."""

    help = "Create, revoke or list the router's API keys."

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="{create,revoke,list}")
        create = actions.add_parser("create", help="Create a key and print it once (only its hash is stored).")
        create_api_key.Command().add_arguments(create)
        revoke = actions.add_parser(
            "revoke", help="Revoke keys by prefix (the start shown by `list`); routers refuse them within a second."
        )
        revoke.add_argument("prefixes", nargs="+", metavar="PREFIX", help="A key's prefix, as `keys list` shows it.")
        actions.add_parser("list", help="Every key: name, prefix, active or revoked, expiry, limits.")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        if action == "create":
            names = ("key", "models", "pools", "expires", "rpm", "tpm")
            call_command("create_api_key", options["name"], **{n: options[n] for n in names}, stdout=self.stdout)
        elif action == "revoke":
            self._revoke(options["prefixes"])
        else:
            for key in ApiKey.objects.order_by("created_at", "id"):
                state = "active" if key.active else "revoked"
                expiry = key.expires_at.isoformat() if key.expires_at else "never"
                limits = f"rpm={key.rpm or '-'} tpm={key.tpm or '-'}"
                self.stdout.write(f"{key.prefix}\t{state}\t{expiry}\t{limits}\t{key.name}")

    def _revoke(self, prefixes: list[str]) -> None:
        found = {prefix: list(ApiKey.objects.filter(prefix__startswith=prefix)) for prefix in prefixes}
        unknown = [prefix for prefix, keys in found.items() if not keys]
        ambiguous = [prefix for prefix, keys in found.items() if len(keys) > 1]
        if unknown or ambiguous:
            problems = [f"no key starts with {p!r}" for p in unknown] + [
                f"{p!r} starts {len(found[p])} keys: give more of it" for p in ambiguous
            ]
            raise CommandError("; ".join(problems) + " (nothing revoked)")
        ids = [keys[0].pk for keys in found.values()]
        count = set_keys_active(ApiKey.objects.filter(pk__in=ids), False)
        self.stdout.write(f"revoked {count} key(s); {len(ids) - count} already were")
