"""--enable-log-requests (vLLM's RequestLogger): a line when a request reaches the engine (its id,
prompt, token ids and sampling params, cut to --max-log-len) and one when it is aborted."""

from __future__ import annotations

import logging

from jaxlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams) -> None:
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len] if prompt is not None else None
            prompt_token_ids = prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, prompt, params, prompt_token_ids)

    def log_aborted(self, request_id: str) -> None:
        logger.info("Aborted request %s.", request_id)
