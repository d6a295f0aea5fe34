# The key tables were created by the router app (router 0001, 0002). This takes them over as they are:
# the models enter the keys app's state on the router's tables, and the database is not touched.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('router', '0002_key_scopes_limits_and_token_usage'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ApiKey',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100)),
                        ('prefix', models.CharField(help_text='The start of the key, to recognise it.', max_length=24)),
                        ('key_hash', models.CharField(max_length=64, unique=True)),
                        ('active', models.BooleanField(default=True, help_text='Untick to revoke: every router refuses it within a second.')),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('allowed_models', models.JSONField(blank=True, default=list, help_text='Models (names or aliases) it may use, e.g. ["llama3"]; empty = all.')),
                        ('allowed_pools', models.JSONField(blank=True, default=list, help_text='Pools whose replicas serve it; empty = any.')),
                        ('expires_at', models.DateTimeField(blank=True, help_text='Refused from then on; empty = never.', null=True)),
                        ('rpm', models.PositiveIntegerField(blank=True, help_text='Requests per minute; empty = no limit.', null=True)),
                        ('tpm', models.PositiveIntegerField(blank=True, help_text='Tokens per minute; empty = no limit.', null=True)),
                        ('last_used_at', models.DateTimeField(blank=True, editable=False, null=True)),
                    ],
                    options={
                        'verbose_name': 'API key',
                        'ordering': ['name', 'id'],
                        'db_table': 'router_apikey',
                    },
                ),
                migrations.CreateModel(
                    name='TokenUsage',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('key_name', models.CharField(help_text="The key's name when counted (kept if it is deleted).", max_length=100)),
                        ('model', models.CharField(max_length=200)),
                        ('hour', models.DateTimeField(help_text='Start of the hour (UTC).')),
                        ('requests', models.PositiveBigIntegerField(default=0)),
                        ('prompt_tokens', models.PositiveBigIntegerField(default=0)),
                        ('completion_tokens', models.PositiveBigIntegerField(default=0)),
                        ('key', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='token_usage', to='keys.apikey')),
                    ],
                    options={
                        'ordering': ['-hour', 'key_name', 'model'],
                        'db_table': 'router_tokenusage',
                        'constraints': [models.UniqueConstraint(fields=('key', 'model', 'hour'), name='token_usage_one_row_per_hour')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
