"""SchedulerConfig: continuous batching, what one step may hold."""

from __future__ import annotations

import dataclasses

from jaxlm.config.utils import SCHEDULING_POLICIES, arg, human_readable_int


@dataclasses.dataclass
class SchedulerConfig:
    """Continuous batching: what one step may hold."""

    max_num_seqs: int = arg(64, "most requests running in one step")
    # 512 keeps a prefill step short enough not to stall the decodes beside it on CPU.
    max_num_batched_tokens: int = arg(512, "token budget of one step (chunked prefill splits longer prompts)",
                                      parse=human_readable_int)
    max_num_queued_reqs: int | None = arg(None, "most waiting requests before new ones are refused (HTTP 429)")
    async_scheduling: bool = arg(True, "schedule and prepare step N+1 while the device runs step N (decode "
                                       "inputs come from step N's tokens on the device); steps with "
                                       "structured outputs, penalties, min_tokens or bad words run synchronously, "
                                       "and it is off under pipeline parallel, several nodes or --token-buckets auto")
    scheduling_policy: str = arg("fcfs", "waiting-queue order: fcfs (arrival order; preemption takes the newest) "
                                         "or priority (each request's priority, lower first, ties by arrival; "
                                         "preemption takes the worst)", choices=SCHEDULING_POLICIES)
    # Not an argument: ModelConfig.max_model_len once resolved against the model (the engine
    # copies it here; the scheduler and the runner read it from here).
    max_model_len: int | None = None
    # Not an argument: vLLM's disable_chunked_mm_input, set by the engine core for a model whose
    # image tokens attend to each other (Gemma 3): a chunk never ends inside an image.
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling_policy {self.scheduling_policy!r}; choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
