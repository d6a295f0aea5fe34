"""`manage.py settings_table`: the Configuration table of docs/configuration.md, printed from the settings registry."""

from django.core.management.base import BaseCommand

from llmgw_site.config import markdown_table


class Command(BaseCommand):
    help = "Print the Markdown table of every environment setting, its default and meaning (docs/configuration.md)."

    def handle(self, *args, **options):
        self.stdout.write(markdown_table(), ending="")
