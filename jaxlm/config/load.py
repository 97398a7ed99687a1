"""LoadConfig: how the checkpoint is read."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import LOAD_FORMATS, arg


@dataclasses.dataclass
class LoadConfig:
    """How the checkpoint is read."""

    load_format: str = arg("auto", "checkpoint format (auto: from the path)", choices=LOAD_FORMATS)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"Unknown load format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}"
            )
