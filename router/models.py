"""Router models: API keys (stored hashed, shown once)."""

import hashlib
import secrets

from django.db import models

KEY_PREFIX = "sk-llmgw-"


def hash_key(key: str) -> str:
    """Keys are long random strings, so one round of SHA-256 is enough to store them."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet):
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
        plaintext = key or KEY_PREFIX + secrets.token_urlsafe(32)
        api_key = cls.objects.create(name=name, prefix=plaintext[: len(KEY_PREFIX) + 6], key_hash=hash_key(plaintext))
        return api_key, plaintext
