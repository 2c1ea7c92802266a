"""Find environment factories: entry points in group ``rollwise.envs`` (by name) or ``module:attr``.

Resolution is lazy: listing reads only distribution metadata, and resolving a name imports only the
module of that one entry point, so a broken or slow plugin cannot affect runs that do not use it.
A name declared by two distributions is an error naming both (never a silent first-wins).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from envs.api import EnvFactory
from envs.sync_adapter import SyncEnvironment, as_async_factory

ENTRY_POINT_GROUP = "rollwise.envs"


class EnvDiscoveryError(Exception):
    """An environment name or path could not be resolved; the message says why and what exists."""


@dataclass(frozen=True)
class EnvInfo:
    """One installed environment: entry-point name, ``module:attr`` value, and where it comes from."""

    name: str
    value: str
    distribution: str
    version: str


def _group_entry_points() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    """(entry point, distribution name, distribution version) for every entry point of the group."""
    found = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry_point.dist
        name = dist.name if dist is not None else "<unknown>"
        version = dist.version if dist is not None else "<unknown>"
        found.append((entry_point, str(name), str(version)))
    return found


def _candidates() -> dict[str, list[tuple[EnvInfo, importlib.metadata.EntryPoint]]]:
    by_name: dict[str, list[tuple[EnvInfo, importlib.metadata.EntryPoint]]] = {}
    for entry_point, distribution, version in _group_entry_points():
        info = EnvInfo(entry_point.name, entry_point.value, distribution, version)
        same_name = by_name.setdefault(entry_point.name, [])
        # One distribution seen twice on sys.path (e.g. an editable install) is not a collision.
        if all(known.distribution != distribution for known, _ in same_name):
            same_name.append((info, entry_point))
    return by_name


def list_envs() -> list[EnvInfo]:
    """Every installed environment, sorted by name; imports no plugin code."""
    return sorted((info for infos in _candidates().values() for info, _ in infos), key=lambda i: i.name)


def resolve_env(name_or_path: str) -> EnvFactory:
    """The factory for an entry-point name (``"guess-number"``) or a ``"module:attr"`` path.

    A ``SyncEnvironment`` subclass is wrapped with ``as_async_factory``. Raises EnvDiscoveryError for
    an unknown name (listing the available ones), a name declared by several distributions, an import
    failure, or an object that is not callable.
    """
    if ":" in name_or_path:
        target = _load_path(name_or_path)
        origin = name_or_path
    else:
        target = _load_entry_point(name_or_path)
        origin = f"entry point {name_or_path!r}"
    if isinstance(target, type) and issubclass(target, SyncEnvironment):
        return as_async_factory(target)
    if not callable(target):
        raise EnvDiscoveryError(f"{origin} names {target!r}, which is not a factory (not callable)")
    factory: EnvFactory = target
    return factory


def _load_path(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise EnvDiscoveryError(f"{path!r} is not a 'module:attr' path")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvDiscoveryError(f"cannot import module {module_name!r} for {path!r}: {exc!r}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EnvDiscoveryError(f"{path!r}: {module_name!r} has no attribute {attribute!r}") from None
    return target


def _load_entry_point(name: str) -> Any:
    candidates = _candidates()
    matches = candidates.get(name, [])
    if not matches:
        available = ", ".join(sorted(candidates)) or "none installed"
        raise EnvDiscoveryError(
            f"no environment named {name!r} in entry-point group {ENTRY_POINT_GROUP!r} "
            f"(available: {available}); a 'module:attr' path also works"
        )
    if len(matches) > 1:
        origins = ", ".join(f"{info.distribution} {info.version} ({info.value})" for info, _ in matches)
        raise EnvDiscoveryError(
            f"environment name {name!r} is declared by several distributions: {origins}; "
            "uninstall one or use a 'module:attr' path"
        )
    info, entry_point = matches[0]
    try:
        return entry_point.load()
    except Exception as exc:
        raise EnvDiscoveryError(
            f"cannot load environment {name!r} ({info.value}) from {info.distribution}: {exc!r}"
        ) from exc


def main_list(argv: Sequence[str] | None = None) -> int:
    """``rollwise envs [--json]``: print installed environments (name, version, distribution)."""
    parser = argparse.ArgumentParser(prog="rollwise envs", description="List installed environments.")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = parser.parse_args(argv)
    infos = list_envs()
    if args.json:
        print(json.dumps([asdict(info) for info in infos], indent=2))
        return 0
    if not infos:
        print(f"no environments installed (entry-point group {ENTRY_POINT_GROUP!r})")
        return 0
    rows = [("NAME", "VERSION", "DISTRIBUTION", "FACTORY")] + [
        (i.name, i.version, i.distribution, i.value) for i in infos
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[3])
    return 0


if __name__ == "__main__":
    sys.exit(main_list())
