"""`manage.py enrol_node NAME [--address A] [--fabric F]`: create a node and print its agent token once."""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from inventory.services import EnrolmentError, enrol_node


def _sentence(error: ValidationError) -> str:
    if hasattr(error, "error_dict"):
        return "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in error.message_dict.items())
    return " ".join(error.messages)


class Command(BaseCommand):
    help = "Enrol a GPU node: create it with a fresh credential and print the token its agent needs (shown once)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="The node's name, as its agent will report it.")
        parser.add_argument("--address", default="", help="Host or IP engines on this node are reached on.")
        parser.add_argument("--fabric", default="", help="Interconnect domain, e.g. an InfiniBand fabric name.")

    def handle(self, *args, name, address, fabric, **options):
        try:
            node, token = enrol_node(name, address=address, fabric=fabric)
        except EnrolmentError as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:
            raise CommandError(f"cannot enrol node “{name}”: {_sentence(exc)}") from None
        # The token alone on stdout, so scripts can capture it.
        self.stdout.write(token)
        self.stderr.write(
            self.style.WARNING(
                f"Enrolled node “{node.name}”. Give this token to its agent; it will not be shown again."
            )
        )
