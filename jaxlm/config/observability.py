"""ObservabilityConfig: logging of stats and requests."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import arg


@dataclasses.dataclass
class ObservabilityConfig:
    """Logging of stats and requests."""

    disable_log_stats: bool = arg(False, "no periodic throughput / cache usage log lines")
    enable_log_requests: bool = arg(False, "log each request's arrival and parameters")
