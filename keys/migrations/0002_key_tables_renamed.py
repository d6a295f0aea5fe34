# The key tables take the keys app's names, and their content types move with them, so permissions
# granted on API keys and admin history keep pointing at them.

from typing import Any

from django.db import migrations

MODELS = ['apikey', 'tokenusage']


def move_content_types(apps: Any, from_label: str, to_label: str) -> None:
    content_types = apps.get_model('contenttypes', 'ContentType')
    # A model whose new label already has a content type keeps that one; the old one is then stale.
    taken = set(content_types.objects.filter(app_label=to_label, model__in=MODELS).values_list('model', flat=True))
    content_types.objects.filter(app_label=from_label, model__in=set(MODELS) - taken).update(app_label=to_label)


def forwards(apps: Any, schema_editor: Any) -> None:
    move_content_types(apps, 'router', 'keys')


def backwards(apps: Any, schema_editor: Any) -> None:
    move_content_types(apps, 'keys', 'router')


class Migration(migrations.Migration):

    dependencies = [
        ('contenttypes', '0002_remove_content_type_name'),
        ('keys', '0001_initial'),
    ]

    operations = [
        migrations.AlterModelTable(name='apikey', table=None),
        migrations.AlterModelTable(name='tokenusage', table=None),
        migrations.RunPython(forwards, backwards),
    ]
