"""What every config section shares: the strict base model, secrets read from the environment, the
loopback test. Imports nothing of rollwise."""

from __future__ import annotations

import ipaddress
import os

from pydantic import BaseModel, ConfigDict, SecretStr


class Section(BaseModel):
    """A config table: unknown keys are refused (a typo is an error naming the key, not a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def reveal(secret: SecretStr | None) -> str | None:
    """The plain value of an API key setting, for the one place that sends it."""
    return secret.get_secret_value() if secret is not None else None


def secret_from_env(name: str) -> SecretStr | None:
    value = os.environ.get(name)
    return SecretStr(value) if value else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
