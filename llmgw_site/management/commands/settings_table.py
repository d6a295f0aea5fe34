"""`manage.py settings_table`: the README's Configuration table, printed from the settings registry."""

from django.core.management.base import BaseCommand

from llmgw_site.config import markdown_table


class Command(BaseCommand):
    help = "Print the Markdown table of every environment setting, its default and meaning (README: Configuration)."

    def handle(self, *args, **options):
        self.stdout.write(markdown_table(), ending="")
