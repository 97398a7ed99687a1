"""ObservabilityConfig: logging of stats and requests."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import arg


@dataclasses.dataclass
class ObservabilityConfig:
    """Logging of stats and requests."""

    disable_log_stats: bool = arg(False, "no periodic throughput / cache usage log line (every 5 s while the "
                                         "engine works; $JAXLM_LOG_STATS_INTERVAL sets the seconds)")
    enable_log_requests: bool = arg(False, "log each request's arrival (id, prompt, token ids, sampling "
                                           "params) and each abort")
    max_log_len: int | None = arg(None, "most prompt characters and token ids a request's log line shows "
                                        "(default: all)")

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
