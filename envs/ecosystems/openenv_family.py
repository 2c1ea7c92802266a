"""The ``openenv`` family (entry point group ``rollwise.env_families``): ``openenv/<name>``.

Members are the OpenEnv environments installed in the OpenEnv venv (`make env-openenv`): its
``openenv-<name>`` distributions (``openenv-core``, the library itself, aside), found the way OpenEnv's
own discovery does (openenv/auto/_discovery.py: module = ``<name>`` with ``-`` as ``_``), by reading the
venv's distribution metadata from this process, never importing them. Any other dotted module with a
``server/app.py`` works too, with ``env.options.path`` (or ``base_url`` for a server the user runs).
"""

from __future__ import annotations

import functools
import importlib.metadata

from envs.api import EnvFactory, EnvFamily, FamilyMember
from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python, venvs_root
from envs.ecosystems.openenv_env import OpenEnvEnvironment, module_of

DISTRIBUTION_PREFIX = "openenv-"
NOT_ENVIRONMENTS = frozenset({"openenv-core"})


def installed_environments() -> dict[str, str]:
    """Module name -> ``<distribution> <version>`` for each OpenEnv environment in the OpenEnv venv.
    ImportError (naming `make env-openenv`) when the venv is missing."""
    try:
        venv_python("openenv")
    except EcosystemMissing as exc:
        raise ImportError(str(exc)) from None
    site_packages = [str(p) for p in (venvs_root() / "openenv" / "lib").glob("python*/site-packages")]
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=site_packages):
        name = str(dist.metadata["Name"] or "")
        if name.lower().startswith(DISTRIBUTION_PREFIX) and name.lower() not in NOT_ENVIRONMENTS:
            found[name[len(DISTRIBUTION_PREFIX) :].replace("-", "_")] = f"{name} {dist.version}"
    return found


def members() -> list[FamilyMember]:
    return [FamilyMember(module, note) for module, note in sorted(installed_environments().items())]


def factory_for(member: str) -> EnvFactory:
    """``OpenEnvEnvironment`` bound to `member` (a ValueError for a name that cannot be a module)."""
    module_of(member)
    return functools.partial(OpenEnvEnvironment, member)


FAMILY = EnvFamily(name="openenv", factory_for=factory_for, members=members)
