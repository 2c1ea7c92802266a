"""Find environment factories: entry points in group ``rollwise.envs`` (by name), families in group
``rollwise.env_families`` (``family/member``), or a path (``module:attr``, ``path/to/file.py:attr``).

Resolution is lazy: listing reads only distribution metadata, and resolving a name imports only the
module of that one entry point, so a broken or slow plugin cannot affect runs that do not use it.
A name declared by two distributions is an error naming both (never a silent first-wins).

An entry point may name extras (``"envs.textarena_games:FAMILY [textarena]"``): when the distribution's
requirements for them are not installed, listing shows the ``pip install`` that adds them, still without
importing anything.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from envs.api import EnvFactory, EnvFamily
from envs.sync_adapter import SyncEnvironment, as_async_factory

ENTRY_POINT_GROUP = "rollwise.envs"
FAMILY_GROUP = "rollwise.env_families"


class EnvDiscoveryError(Exception):
    """An environment name or path could not be resolved; the message says why and what exists."""


@dataclass(frozen=True)
class EnvInfo:
    """One installed environment: entry-point name, ``module:attr`` value, and where it comes from."""

    name: str
    value: str
    distribution: str
    version: str
    note: str = ""


def _entry_points_of(group: str) -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    found = []
    for entry_point in importlib.metadata.entry_points(group=group):
        dist = entry_point.dist
        name = dist.name if dist is not None else "<unknown>"
        version = dist.version if dist is not None else "<unknown>"
        found.append((entry_point, str(name), str(version)))
    return found


def _group_entry_points() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    """(entry point, distribution name, distribution version) for every entry point of the group."""
    return _entry_points_of(ENTRY_POINT_GROUP)


def _family_entry_points() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    """The same for the families' group."""
    return _entry_points_of(FAMILY_GROUP)


_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalise_extra(name: str) -> str:
    # PEP 685. Entry-point values split extras at non-word characters, so "[reasoning_gym]" is how an
    # entry point names the extra "reasoning-gym".
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_extras(entry_point: importlib.metadata.EntryPoint) -> list[str]:
    """The entry point's extras whose requirements are not all installed (metadata only, no imports)."""
    dist = entry_point.dist
    if not entry_point.extras or dist is None:
        return []
    missing = []
    for extra in map(_normalise_extra, entry_point.extras):
        for requirement in dist.requires or []:
            marker = _EXTRA_MARKER.search(requirement)
            name = _REQUIREMENT_NAME.match(requirement)
            if marker is None or _normalise_extra(marker.group(1)) != extra or name is None:
                continue
            try:
                importlib.metadata.distribution(name.group(1))
            except importlib.metadata.PackageNotFoundError:
                missing.append(extra)
                break
    return missing


def _install_hint(distribution: str, extras: list[str]) -> str:
    return f"not installed: pip install '{distribution}[{','.join(extras)}]'"


def _candidates(
    group: str = ENTRY_POINT_GROUP,
) -> dict[str, list[tuple[EnvInfo, importlib.metadata.EntryPoint]]]:
    by_name: dict[str, list[tuple[EnvInfo, importlib.metadata.EntryPoint]]] = {}
    listed = _group_entry_points() if group == ENTRY_POINT_GROUP else _family_entry_points()
    for entry_point, distribution, version in listed:
        missing = missing_extras(entry_point)
        note = _install_hint(distribution, missing) if missing else ""
        shown = f"{entry_point.name}/<member>" if group == FAMILY_GROUP else entry_point.name
        info = EnvInfo(shown, entry_point.value, distribution, version, note)
        same_name = by_name.setdefault(entry_point.name, [])
        # One distribution seen twice on sys.path (e.g. an editable install) is not a collision.
        if all(known.distribution != distribution for known, _ in same_name):
            same_name.append((info, entry_point))
    return by_name


def list_envs() -> list[EnvInfo]:
    """Every installed environment and family (``family/<member>``), sorted by name; imports no plugin
    code. A family or environment whose extras are missing carries the install hint in ``note``."""
    infos = [
        info
        for group in (ENTRY_POINT_GROUP, FAMILY_GROUP)
        for infos in _candidates(group).values()
        for info, _ in infos
    ]
    return sorted(infos, key=lambda i: i.name)


def import_failures() -> dict[str, str]:
    """Name (as `list_envs` shows it) -> why its entry point cannot be loaded, for every installed
    environment and family whose extras are present. This imports each plugin's module (`rollwise envs`
    runs it, a run never does): a plugin that lists fine but does not import would otherwise only fail
    when a run names it."""
    failures: dict[str, str] = {}
    for group in (ENTRY_POINT_GROUP, FAMILY_GROUP):
        for infos in _candidates(group).values():
            for info, entry_point in infos:
                if info.note:  # its extras are missing: the install hint says more than the ImportError
                    continue
                try:
                    entry_point.load()
                except Exception as exc:
                    failures[info.name] = f"{type(exc).__name__}: {exc}"
    return failures


def load_family(name: str) -> EnvFamily:
    """The EnvFamily an entry point of ``rollwise.env_families`` names (imports its module only)."""
    target = _load_entry_point(name, FAMILY_GROUP)
    if not isinstance(target, EnvFamily):
        raise EnvDiscoveryError(f"family entry point {name!r} names {target!r}, which is not an EnvFamily")
    return target


def resolve_env(name_or_path: str) -> EnvFactory:
    """The factory for an entry-point name (``"guess-number"``), a family member
    (``"textarena/GuessTheNumber-v0"``) or a path (``"module:attr"``, ``"path/to/file.py:attr"``).

    A ``SyncEnvironment`` subclass is wrapped with ``as_async_factory``. Raises EnvDiscoveryError for
    an unknown name (listing the available ones), a name declared by several distributions, an import
    failure, a member its family refuses (with the family's reason), or an object that is not callable.
    """
    if ":" in name_or_path:
        target = load_object(name_or_path)
        origin = name_or_path
    elif "/" in name_or_path:
        family_name, _, member = name_or_path.partition("/")
        family = load_family(family_name)
        try:
            target = family.factory_for(member)
        except (ValueError, ImportError) as exc:
            raise EnvDiscoveryError(f"{name_or_path}: {exc}") from None
        origin = f"family member {name_or_path!r}"
    else:
        if name_or_path not in _candidates() and name_or_path in _candidates(FAMILY_GROUP):
            raise EnvDiscoveryError(
                f"{name_or_path!r} is a family of environments: name one of its members, "
                f"'{name_or_path}/<member>' (`rollwise envs {name_or_path}` lists them)"
            )
        target = _load_entry_point(name_or_path)
        origin = f"entry point {name_or_path!r}"
    if isinstance(target, type) and issubclass(target, SyncEnvironment):
        return as_async_factory(target)
    if not callable(target):
        raise EnvDiscoveryError(f"{origin} names {target!r}, which is not a factory (not callable)")
    factory: EnvFactory = target
    return factory


def load_object(path: str) -> Any:
    """The object a ``"module:attr"`` or ``"path/to/file.py:attr"`` path names (a file path is relative
    to the working directory; the file is imported once per absolute path). EnvDiscoveryError otherwise."""
    module_name, _, attribute = path.rpartition(":") if path.count(":") > 1 else path.partition(":")
    if not module_name or not attribute:
        raise EnvDiscoveryError(f"{path!r} is not a 'module:attr' path")
    try:
        target: Any = (
            _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        )
    except EnvDiscoveryError:
        raise
    except Exception as exc:
        raise EnvDiscoveryError(f"cannot import module {module_name!r} for {path!r}: {exc!r}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EnvDiscoveryError(f"{path!r}: {module_name!r} has no attribute {attribute!r}") from None
    return target


def _import_file(file_path: str) -> Any:
    path = Path(file_path).resolve()
    if not path.is_file():
        raise EnvDiscoveryError(f"no such file {file_path!r} (resolved to {path})")
    # One module per absolute path: two options naming the same file share its objects.
    module_name = (
        f"rollwise_file_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()}"
    )
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise EnvDiscoveryError(f"cannot import {file_path!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _load_entry_point(name: str, group: str = ENTRY_POINT_GROUP) -> Any:
    candidates = _candidates(group)
    matches = candidates.get(name, [])
    if not matches:
        available = ", ".join(sorted(candidates)) or "none installed"
        what = "environment" if group == ENTRY_POINT_GROUP else "environment family"
        raise EnvDiscoveryError(
            f"no {what} named {name!r} in entry-point group {group!r} "
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
        hint = f" ({info.note})" if info.note else ""
        raise EnvDiscoveryError(
            f"cannot load environment {name!r} ({info.value}) from {info.distribution}: {exc!r}{hint}"
        ) from exc


def _main_family(name: str, as_json: bool) -> int:
    """``rollwise envs FAMILY``: the members the family's library offers, with what each needs."""
    try:
        members = load_family(name).members()
    except EnvDiscoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"error: family {name!r} cannot list its members: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([{"name": f"{name}/{m.name}", "note": m.note} for m in members], indent=2))
        return 0
    width = max((len(name) + 1 + len(m.name) for m in members), default=0)
    for member in members:
        print(
            f"{name}/{member.name}".ljust(width) + f"  {member.note}"
            if member.note
            else f"{name}/{member.name}"
        )
    return 0


def main_list(argv: Sequence[str] | None = None) -> int:
    """``rollwise envs [FAMILY] [--json]``: print installed environments (name, version, distribution,
    factory, and an install hint for a family whose library is missing), or a family's members."""
    parser = argparse.ArgumentParser(prog="rollwise envs", description="List installed environments.")
    parser.add_argument("family", nargs="?", help="list the members of this family (e.g. textarena)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument(
        "--no-import", action="store_true", help="read metadata only (do not check that each one imports)"
    )
    args = parser.parse_args(argv)
    if args.family is not None:
        return _main_family(args.family, args.json)
    infos = list_envs()
    failures = {} if args.no_import else import_failures()
    if args.json:
        print(json.dumps([{**asdict(i), "import_error": failures.get(i.name)} for i in infos], indent=2))
        return 0
    if not infos:
        print(f"no environments installed (entry-point group {ENTRY_POINT_GROUP!r})")
        return 0
    rows = [("NAME", "VERSION", "DISTRIBUTION", "FACTORY")] + [
        (i.name, i.version, i.distribution, i.value) for i in infos
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row, info in zip(rows, [None, *infos], strict=True):
        line = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[3]
        notes = [] if info is None else [info.note] if info.note else []
        if info is not None and info.name in failures:
            notes.append(f"IMPORT FAILS: {failures[info.name]}")
        print(line + "".join(f"  ({note})" for note in notes))
    if failures:
        print(f"{len(failures)} of {len(infos)} cannot be imported: a run naming one stops at its start")
    return 0


if __name__ == "__main__":
    sys.exit(main_list())
