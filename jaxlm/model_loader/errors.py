"""Load errors: each names the file and the tensor so a user can fix the checkpoint."""

from __future__ import annotations


class WeightLoadError(ValueError):
    """Base class: loading a model's weights failed; nothing half-loaded is returned."""


class MissingWeightsError(WeightLoadError):
    def __init__(self, source: str, names: list[str]):
        shown = ", ".join(sorted(names)[:10]) + (" ..." if len(names) > 10 else "")
        super().__init__(f"{source}: missing {len(names)} weight(s): {shown}")
        self.names = names


class UnexpectedWeightError(WeightLoadError):
    def __init__(self, source: str, name: str):
        super().__init__(f"{source}: unexpected weight {name!r} (no parameter of the model takes it)")
        self.name = name


class WeightShapeError(WeightLoadError):
    def __init__(self, source: str, name: str, expected: tuple, got: tuple):
        super().__init__(f"{source}: weight {name!r} has shape {tuple(got)}, the model expects {tuple(expected)}")
        self.name = name


class UnsupportedDtypeError(WeightLoadError):
    def __init__(self, source: str, name: str, dtype: str):
        super().__init__(f"{source}: weight {name!r} has unsupported dtype {dtype}")
        self.name = name


class CorruptCheckpointError(WeightLoadError):
    def __init__(self, source: str, why: str):
        super().__init__(f"{source}: corrupt or truncated checkpoint: {why}")


class NoWeightsError(WeightLoadError):
    def __init__(self, source: str, why: str = "no *.safetensors, *.gguf or orbax checkpoint found"):
        super().__init__(f"{source}: {why}")
