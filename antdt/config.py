"""Framework defaults: ``antdt/antdt.yaml`` merged into ``dask.config`` on import.

Read values with ``dask.config.get("antdt.sharding.commit-interval")``; override them like any
Dask setting (``DASK_ANTDT__SHARDING__COMMIT_INTERVAL=2s``, a YAML file in ``~/.config/dask``, or
``dask.config.set``).
"""

from __future__ import annotations

import os

import dask.config
import dask.utils
import yaml

from antdt.errors import ConfigError

_PATH = os.path.join(os.path.dirname(__file__), "antdt.yaml")

with open(_PATH) as _file:
    defaults = yaml.safe_load(_file)

dask.config.update_defaults(defaults)


def seconds(key: str) -> float:
    """A duration setting (``"1s"``, ``"250ms"`` or a number of seconds) as float seconds."""
    value = dask.config.get(key, default=None)
    if value is None:  # a config reset after import (e.g. Dask's test harness) drops our keys
        value = _default(key)
    try:
        parsed = dask.utils.parse_timedelta(value, default="seconds")
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"dask config {key}: expected a duration like '1s', found {value!r}") \
            from e
    if parsed is None:
        raise ConfigError(f"dask config {key}: expected a duration like '1s', found None")
    return float(parsed)


def _default(key: str) -> object:
    """The package default of a dotted ``key``, or None."""
    value: object = defaults
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


_UNSET = object()


def get(key: str) -> object:
    """The value of a dotted dask-config ``key``, falling back to the package default when the
    key is missing (a setting overridden to None, ``DASK_ANTDT__...=None``, stays None)."""
    value = dask.config.get(key, default=_UNSET)
    return _default(key) if value is _UNSET else value


def flag(key: str) -> bool:
    """A yes/no setting; anything but a bool raises :class:`ConfigError` naming the key."""
    value = get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"dask config {key}: expected true or false, found {value!r}")
    return value


def number(key: str, *, low: float = 0.0, high: float = float("inf"),
           integer: bool = False) -> float:
    """A numeric setting in ``[low, high]`` (an int if ``integer``); anything else raises
    :class:`ConfigError` naming the key and the value."""
    value = get(key)
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (integer and not isinstance(value, int)) or not low <= value <= high:
        raise ConfigError(f"dask config {key}: expected {kind} in [{low}, {high}], found "
                          f"{value!r}")
    return value
