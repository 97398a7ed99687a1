"""EngineArgs: the flat list of engine arguments shared by LLM(...) and the server's CLI flags.

Derived from the config dataclasses (jaxlm.config), as vLLM's ``get_kwargs``: every config
field with help text is one EngineArgs field and one ``--flag`` (default, help, choices and
parser from the field), grouped by config in ``--help``. Nothing is declared twice here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from jaxlm.config import (
    ARG_CONFIGS,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    PoolingConfig,
    SchedulerConfig,
    arg_fields,
)

logger = logging.getLogger(__name__)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def _value_type(field: dataclasses.Field) -> Any:
    """The argparse ``type`` of a field: its metadata parser, else from its annotation."""
    parse = field.metadata.get("parse")
    if parse is None:
        base = str(field.type).split("|")[0].strip()
        return {"int": int, "float": float}.get(base, str)

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse shows an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(e)) from e

    typed.__name__ = parse.__name__
    return typed


def _add_field(group: argparse._ArgumentGroup, field: dataclasses.Field) -> None:
    meta = field.metadata
    flags = ["--" + field.name.replace("_", "-"), *meta["flags"]]
    kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": meta["help"]}
    if str(field.type) == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _value_type(field)
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        if meta["nargs"]:
            kwargs["nargs"] = meta["nargs"]
    group.add_argument(*flags, **kwargs)


class _EngineArgsMethods:
    """The behaviour of EngineArgs; its fields come from the configs (below)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One argument group per config, every default and choice shown in --help."""
        for config_cls in ARG_CONFIGS:
            fields = arg_fields(config_cls)
            if fields:
                group = parser.add_argument_group(config_cls.__name__, config_cls.__doc__)
                for field in fields:
                    _add_field(group, field)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def _build(self, config_cls: type, **extra: Any) -> Any:
        return config_cls(**{f.name: getattr(self, f.name) for f in arg_fields(config_cls)}, **extra)

    def create_engine_config(self) -> EngineConfig:
        """Configs before the model is inspected; the engine resolves model-dependent values
        (ModelConfig.max_model_len, then SchedulerConfig.max_model_len from it)."""
        model_config = self._build(ModelConfig)
        if model_config.trust_remote_code:
            logger.warning("trust_remote_code=True has no effect: jaxlm never runs a model's remote code")
        return self._build(
            EngineConfig,
            model_config=model_config,
            cache_config=self._build(CacheConfig),
            scheduler_config=self._build(SchedulerConfig, max_model_len=model_config.max_model_len),
            parallel_config=self._build(ParallelConfig),
            load_config=self._build(LoadConfig),
            compilation_config=self._build(CompilationConfig),
            observability_config=self._build(ObservabilityConfig),
            lora_config=self._build(LoRAConfig),
            pooling_config=self._build(PoolingConfig),
        )


def _engine_args_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    out, seen = [], set()
    for config_cls in ARG_CONFIGS:
        for f in arg_fields(config_cls):
            if f.name in seen:
                raise TypeError(f"engine argument {f.name!r} is declared by two configs")
            seen.add(f.name)
            out.append((f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata)))
    return out


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", _engine_args_fields(), bases=(_EngineArgsMethods,), namespace={"__module__": __name__})
EngineArgs.__doc__ = ("Every engine argument, flat (LLM(**kwargs), the server's flags); fields and defaults "
                      "are those of the config dataclasses in jaxlm.config.")
