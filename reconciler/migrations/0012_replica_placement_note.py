"""The replica's note on why placement found no room: a note for operators, not an error."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("reconciler", "0011_pending_command_weights_subject"),
    ]

    operations = [
        migrations.RenameField(model_name="replica", old_name="placement_error", new_name="placement_note"),
        migrations.AlterField(
            model_name="replica",
            name="placement_note",
            field=models.TextField(blank=True, help_text="Why the last placement attempt found no room, for operators."),
        ),
    ]
