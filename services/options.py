"""Command-line flags made from settings fields, and the environment that hands them to a child.

Each option is declared once, as a pydantic field of a settings class (its type, default, bounds
and description). Its flag (`--field-name`, or a name of its own), choices, help and environment
variable (the class's env_prefix and the field's name, or the field's LAZYSERVE_* alias) all come
from that field. A flag left out is None in argparse's namespace: the settings decide (the
environment, else the field's default).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import AliasChoices, BaseModel, ByteSize

from shared.settings import EngineSettings


@dataclass(frozen=True)
class Option:
    """One settings field as a command-line flag."""

    settings: type[BaseModel]
    field: str
    flag: str | None = None  # default: --field-name
    repeat: bool = False  # a list given one value per flag (--api-key A --api-key B)

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag_name.removeprefix("--").replace("-", "_")

    @property
    def info(self):
        return self.settings.model_fields[self.field]

    @property
    def env(self) -> str:
        """The environment variable the settings read this field from."""
        alias = self.info.validation_alias
        if isinstance(alias, AliasChoices):
            named = [choice for choice in alias.choices if isinstance(choice, str) and choice.isupper()]
            if named:
                return named[0]
        return self.settings.model_config.get("env_prefix", "") + self.field.upper()

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        info = self.info
        kind = _without_none(info.annotation)
        options: dict = {"dest": self.dest, "default": None}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = list(typing.get_args(kind))
        elif self.repeat:
            options["action"] = "append"
        elif kind in (int, float):
            options["type"] = kind
        default = info.get_default(call_default_factory=False)
        shown = "" if default is None or info.default_factory is not None else f"; default {_shown(default)}"
        options["help"] = f"{info.description or self.field.replace('_', ' ')} ({self.env}{shown})"
        parser.add_argument(self.flag_name, **options)

    def value_of(self, args: argparse.Namespace):
        return getattr(args, self.dest, None)


def _without_none(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def _shown(value) -> str:
    if isinstance(value, ByteSize):
        return value.human_readable(separator="")
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_flags(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    for option in options:
        option.add_to(parser)


def given(args: argparse.Namespace, options: Iterable[Option]) -> dict[Option, object]:
    """The options set on the command line, with their values."""
    return {option: option.value_of(args) for option in options if option.value_of(args) is not None}


def of(values: dict[Option, object], settings: type[BaseModel]) -> dict[Option, object]:
    """The options among `values` that are fields of `settings`."""
    return {option: value for option, value in values.items() if option.settings is settings}


def fields_of(values: dict[Option, object], settings: type[BaseModel]) -> dict[str, object]:
    """`settings`' fields among `values`, by field name: what `settings(**...)` takes."""
    return {option.field: value for option, value in of(values, settings).items()}


def build(settings: type[BaseModel], args: argparse.Namespace, options: Iterable[Option]):
    """`settings` from the flags given (the environment and defaults for the rest); the engine's
    flags go to its `engine` field."""
    values = given(args, options)
    own, engine = fields_of(values, settings), fields_of(values, EngineSettings)
    if settings is EngineSettings:
        return EngineSettings(**own)
    if engine:
        own["engine"] = EngineSettings(**engine)
    return settings(**own)


def environment(values: dict[Option, object]) -> dict[str, str]:
    """The environment variables that give a child process these options' values."""
    return {option.env: _env_text(value, _without_none(option.info.annotation)) for option, value in values.items()}


def _env_text(value, kind=None) -> str:
    if kind is Path:  # a child may run elsewhere (a Ray actor): the file by its full name
        return str(Path(value).resolve())
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(_env_text(item) for item in value)
    return str(value)


def engine_options(*fields: str, pruning_flag: str | None = None) -> list[Option]:
    """EngineSettings' fields as flags; `pruning_flag` names the preset's flag where it has one."""
    options = [Option(EngineSettings, field) for field in fields]
    if pruning_flag is not None:
        options.append(Option(EngineSettings, "pruning_preset", pruning_flag))
    return options
