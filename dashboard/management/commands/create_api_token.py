"""`manage.py create_api_token USER`: create (or show) the REST API token of a staff user."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Print USER's REST API token, creating it the first time. USER must be staff (the API is staff only)."

    def add_arguments(self, parser):
        parser.add_argument("user", help="The username of a staff user.")

    def handle(self, *args, **options):
        username = options["user"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named “{username}”; create one with `manage.py createsuperuser`")
        if not (user.is_active and user.is_staff):
            raise CommandError(f"user “{username}” is not an active staff user; the REST API answers staff only")
        token, created = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
        self.stderr.write("new token" if created else "existing token")
