"""`manage.py create_api_key NAME`: issue a router API key and print it once."""

from django.core.management.base import BaseCommand, CommandError

from router.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key for the router. The key is printed once on stdout; only its hash is stored."

    def add_arguments(self, parser):
        parser.add_argument("name", help="Who or what the key is for, e.g. a team or a service.")

    def handle(self, *args, name, **options):
        name = name.strip()
        if not name:
            raise CommandError("the key name must not be empty")
        max_length = ApiKey._meta.get_field("name").max_length
        if len(name) > max_length:
            raise CommandError(f"the key name is {len(name)} characters long; at most {max_length} are allowed")
        api_key, plaintext = ApiKey.issue(name)
        # The key alone on stdout, so `KEY=$(manage.py create_api_key x)` captures exactly it.
        self.stdout.write(plaintext)
        self.stderr.write(
            self.style.WARNING(f"Created API key “{api_key.name}” ({api_key.prefix}…). It will not be shown again.")
        )
