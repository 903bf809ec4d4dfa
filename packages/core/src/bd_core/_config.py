"""`ConfigError`, the one error for a config value that cannot be used, and its message builder.

Every package raises it for its config classes, so a caller catches one type; the message always
names the owner and field, the value given and, where there is one, the fix.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the owner and field, the value given
    and the fix."""


def config_error(owner: str, field: str, value: Any, expected: str, fix: str | None = None) -> ConfigError:
    """`ConfigError("{owner}.{field}: expected {expected}, got {value!r}; {fix}")`, to be raised.

    An empty `owner` leaves just the field; without a `fix` the message ends after the value.
    """
    where = f"{owner}.{field}" if owner else field
    message = f"{where}: expected {expected}, got {value!r}"
    return ConfigError(f"{message}; {fix}" if fix else message)
