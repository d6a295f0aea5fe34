"""Router models: API keys (stored hashed, shown once)."""

from django.db import models

from hub.credentials import hash_secret, new_secret

KEY_PREFIX = "sk-llmgw-"


class ApiKeyQuerySet(models.QuerySet):
    """Queries over API keys."""

    def active(self):
        return self.filter(active=True)


class ApiKey(models.Model):
    """A bearer key clients send to the router. Only its hash and prefix are stored."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=24, help_text="The start of the key, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["name", "id"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(cls, name: str, key: str | None = None) -> tuple["ApiKey", str]:
        """Create a key and return it with its plaintext, which is never stored."""
        plaintext = key or new_secret(KEY_PREFIX)
        api_key = cls.objects.create(
            name=name, prefix=plaintext[: len(KEY_PREFIX) + 6], key_hash=hash_secret(plaintext)
        )
        return api_key, plaintext
