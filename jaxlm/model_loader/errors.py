"""Load errors: each names the file and the tensor so a user can fix the checkpoint."""

from __future__ import annotations


def _rebuild(cls: type, args: tuple, state: dict) -> "WeightLoadError":
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class WeightLoadError(ValueError):
    """Base class: loading a model's weights failed; nothing half-loaded is returned."""

    source: str = "<checkpoint>"

    def with_source(self, source: str) -> "WeightLoadError":
        """The same error naming ``source`` (the real file) instead of the generic source.

        The model only knows the string it was handed; the loader knows which shard the
        offending tensor came from, so it re-raises through this.
        """
        if source == self.source:
            return self
        msg = str(self)
        if msg.startswith(self.source):
            msg = source + msg[len(self.source):]
        return _rebuild(type(self), (msg,), {**self.__dict__, "source": source})

    def __reduce__(self):
        # The subclasses' __init__ take structured arguments, not the message: pickle/copy
        # (e.g. errors crossing a process boundary) must rebuild without calling them.
        return _rebuild, (type(self), self.args, self.__dict__)


class MissingWeightsError(WeightLoadError):
    def __init__(self, source: str, names: list[str]):
        names = sorted(names)
        shown = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
        super().__init__(f"{source}: missing {len(names)} weight(s): {shown}")
        self.source = source
        self.names = names


class UnexpectedWeightError(WeightLoadError):
    def __init__(self, source: str, name: str):
        super().__init__(f"{source}: unexpected weight {name!r} (no parameter of the model takes it)")
        self.source = source
        self.name = name


class WeightShapeError(WeightLoadError):
    def __init__(self, source: str, name: str, expected: tuple, got: tuple):
        super().__init__(f"{source}: weight {name!r} has shape {tuple(got)}, the model expects {tuple(expected)}")
        self.source = source
        self.name = name
        self.expected = tuple(expected)
        self.got = tuple(got)


class UnsupportedDtypeError(WeightLoadError):
    def __init__(self, source: str, name: str, dtype: str):
        super().__init__(f"{source}: weight {name!r} has unsupported dtype {dtype}")
        self.source = source
        self.name = name
        self.dtype = dtype


class CorruptCheckpointError(WeightLoadError):
    def __init__(self, source: str, why: str):
        super().__init__(f"{source}: corrupt or truncated checkpoint: {why}")
        self.source = source


class NoWeightsError(WeightLoadError):
    def __init__(self, source: str, why: str = "no *.safetensors, *.gguf or orbax checkpoint found"):
        super().__init__(f"{source}: {why}")
        self.source = source


class UnsupportedModelError(WeightLoadError):
    """The checkpoint is readable but describes a model jaxlm cannot build (architecture, format)."""

    def __init__(self, source: str, why: str):
        super().__init__(f"{source}: {why}")
        self.source = source
