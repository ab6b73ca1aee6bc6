"""Loading a cluster YAML file: parse, validate, and check the files it names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config.application import ClusterConfig
from cluster.config.base import ConfigError, format_errors
from cluster.models import local_model_path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "embedded.yaml"


def parse_config(
    data: Any,
    source: str = "<config>",
    base_dir: Path | None = None,
    *,
    require_profile: bool = True,
) -> ClusterConfig:
    """Validate already-loaded YAML data; raises ConfigError naming `source` and field paths.
    `require_profile=False` lets a missing `routing.profile` pass (for `cluster calibrate`,
    which writes it)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_errors(source, error)) from None
    config._base_dir = base_dir or Path.cwd()
    config._source = source
    problems = drafter_problems(config) + (profile_problems(config) if require_profile else [])
    if problems:
        raise ConfigError("\n".join(f"{source}: {problem}" for problem in problems))
    return config


def drafter_problems(config: ClusterConfig) -> list[str]:
    """Validate every local drafter against its target (when the target is local too), so a
    broken drafter is refused before anything is deployed. S3 drafters are validated by the
    pool replica after it pulls them."""
    from cluster.drafters import spec

    problems = []
    for i, pool in enumerate(config.pools):
        drafter = pool.speculation.drafter
        if drafter is None or "://" in drafter:
            continue
        field = f"pools[{i}].speculation.drafter"
        path = Path(config.resolve_path(drafter))
        if not path.is_dir():
            problems.append(f"{field}: {drafter}: no such directory")
            continue
        target_dir = Path(local_model_path(config, config.target(pool.target)))
        target = None
        if (target_dir / spec.CONFIG_FILE).is_file():  # embedded models once prepared
            target = spec.read_target_config(target_dir)
        problems += [f"{field}: {problem}" for problem in spec.validate(path, target)]
    return problems


def profile_problems(config: ClusterConfig) -> list[str]:
    """A routing profile that is named must exist (rule v1 would silently take over)."""
    profile = config.routing.profile
    if profile is None or Path(config.resolve_path(profile)).is_file():
        return []
    return [f"routing.profile: {profile}: no such file"]


def load_config(path: str | Path | None = None, *, require_profile: bool = True) -> ClusterConfig:
    """Load and validate a cluster YAML file (default: the embedded preset)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(
            f"{path}: {where}: invalid YAML: {getattr(error, 'problem', error)}"
        ) from None
    return parse_config(data, str(path), path.resolve().parent, require_profile=require_profile)
