"""What every config model shares: strict pydantic models (unknown keys rejected, a docstring
per field) and one-line errors that name the file and the field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem; `str()` is one line per problem, each naming file and field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


def _format_location(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def format_errors(source: str, error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        location = _format_location(tuple(item["loc"]))
        if location:
            # Cross-field validators report `field: problem`; nest their path under ours.
            head, sep, rest = message.partition(": ")
            if sep and " " not in head:
                location, message = f"{location}.{head}", rest
            lines.append(f"{source}: {location}: {message}")
        else:
            lines.append(f"{source}: {message}")
    return "\n".join(lines)


def load_yaml_model(model: type[ModelT], path: str | Path) -> ModelT:
    """A pydantic model from a YAML file; a problem is a `ConfigError` naming the file and the
    field (traces, hardware scales: the files next to the cluster config)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_errors(str(path), error)) from None
