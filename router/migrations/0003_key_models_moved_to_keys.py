# API keys and token usage now belong to the keys app (keys 0001 takes over their tables): the router
# forgets them without touching the database.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('keys', '0001_initial'),
        ('router', '0002_key_scopes_limits_and_token_usage'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='TokenUsage'),
                migrations.DeleteModel(name='ApiKey'),
            ],
            database_operations=[],
        ),
    ]
