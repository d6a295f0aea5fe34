"""Bearer secrets (router API keys, node tokens): how they are stored and compared."""

from __future__ import annotations

import hashlib
import secrets


def hash_secret(secret: str) -> str:
    """The stored form of a secret: long random strings need only one round of SHA-256."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    """A fresh random secret that starts with `prefix`, so it can be recognised."""
    return prefix + secrets.token_urlsafe(32)


def secret_matches(stored_hash: str, presented: str) -> bool:
    """Whether `presented` is the secret behind `stored_hash`, in constant time."""
    return secrets.compare_digest(stored_hash, hash_secret(presented))
