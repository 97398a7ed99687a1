"""Beam search on the engine, as vLLM v1 does it: every beam is an ordinary request.

Each step, every live beam of every prompt runs as one request (its prompt: the prompt plus the
beam's tokens so far; max_tokens 1; 2 × beam_width logprobs). The beams of a prompt share the
prompt's and their common prefix's KV blocks through the prefix cache, so a step computes
only each beam's tail, and nothing new is compiled: these are the greedy (or random) sampler
with logprobs that any request uses. Each beam's candidates are its 2 × beam_width most likely
next tokens; a candidate that is EOS (unless ignore_eos) ends a beam, kept aside; the others
are ranked by score and the best beam_width live on. At the end the finished and live beams
are ranked together; score = cumulative logprob / length ** length_penalty (the length counts
the prompt and leaves out a final EOS, vLLM's rule).

``BeamSearch`` holds the search; ``run_beam_search`` (LLM) and ``run_beam_search_async`` (the
server) feed it the engine's outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence

from jaxlm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Candidates = dict[int, Logprob]


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam. tokens include the prompt; logprobs hold one candidates dict per new token."""

    tokens: list[int]
    logprobs: list[Candidates] = dataclasses.field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    length = max(1, len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0))
    try:
        return cum_logprob / (length ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # a huge |length_penalty|: the same in logs, clamped
        if cum_logprob == 0:
            return 0.0
        log_size = math.log(abs(cum_logprob)) - length_penalty * math.log(length)
        return math.copysign(math.exp(min(log_size, 709.0)), cum_logprob)


@dataclasses.dataclass
class _Instance:
    """One prompt's search."""

    prompt_token_ids: list[int]
    steps_left: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


class BeamSearch:
    """Beam search over several prompts, one token per step. A driver runs step_prompts() as
    requests with ``sampling_params`` and hands each one's candidates dict to advance()."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int, max_logprobs: int) -> None:
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs 2 x beam_width = {2 * params.beam_width} "
                             f"logprobs per step, above max_logprobs={max_logprobs} (raise --max-logprobs)")
        self.params = params
        self.eos_token_id = eos_token_id
        self.sampling_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                              temperature=params.temperature, detokenize=False,
                                              output_kind=RequestOutputKind.FINAL_ONLY)
        # A beam's request must leave room for its one new token within max_model_len.
        self.instances = [_Instance(list(p), min(params.max_tokens, max_model_len - len(p)), [BeamSearchSequence(list(p))])
                          for p in prompts]
        self._stepping: list[_Instance] = []

    @property
    def done(self) -> bool:
        return not any(inst.steps_left > 0 and inst.beams for inst in self.instances)

    def step_prompts(self) -> list[list[int]]:
        """The token ids of every beam to extend in this step, prompt by prompt."""
        self._stepping = [inst for inst in self.instances if inst.steps_left > 0 and inst.beams]
        return [beam.tokens for inst in self._stepping for beam in inst.beams]

    def advance(self, candidates: Sequence[Candidates]) -> None:
        """One candidates dict ({token id: Logprob}) per prompt of the last step_prompts()."""
        expected = sum(len(inst.beams) for inst in self._stepping)
        if len(candidates) != expected:
            raise ValueError(f"expected {expected} candidate sets, got {len(candidates)}")
        it = iter(candidates)
        for inst in self._stepping:
            grown = []
            for beam in inst.beams:
                cands = next(it)
                for token_id, lp in cands.items():
                    new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [cands],
                                             beam.cum_logprob + lp.logprob)
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        inst.completed.append(new)  # kept aside: it competes in the final ranking only
                    else:
                        grown.append(new)
            inst.beams = sorted(grown, key=self._score, reverse=True)[:self.params.beam_width]
            inst.steps_left -= 1
        self._stepping = []

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def best(self) -> list[list[BeamSearchSequence]]:
        """Per prompt: the beam_width best of the finished and live beams, best first."""
        out = []
        for inst in self.instances:
            for beam in inst.beams:
                beam.finish_reason = beam.finish_reason or "length"
            ranked = sorted(inst.completed + inst.beams, key=self._score, reverse=True)
            out.append(ranked[:self.params.beam_width])
        return out

    def output_tokens(self, index: int, beam: BeamSearchSequence) -> list[int]:
        """The beam's generated tokens (the EOS that ended it included)."""
        return beam.tokens[len(self.instances[index].prompt_token_ids):]

    def output_text_tokens(self, index: int, beam: BeamSearchSequence) -> list[int]:
        """The generated tokens whose text is shown (a final EOS only with include_stop_str_in_output)."""
        tokens = self.output_tokens(index, beam)
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return tokens


def _candidates(out: RequestOutput) -> Candidates:
    completion = out.outputs[0]
    if not completion.logprobs:
        raise RuntimeError(f"beam search step failed: request {out.request_id!r} finished "
                           f"{completion.finish_reason!r} without logprobs")
    return completion.logprobs[0]


def run_beam_search(search: BeamSearch, generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
                    decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
    """LLM.beam_search: each step's beams through ``generate`` (outputs in input order). Text
    decodes every token, the prompt's included (vLLM's LLM.beam_search)."""
    while not search.done:
        search.advance([_candidates(o) for o in generate(search.step_prompts(), search.sampling_params)])
    outputs = []
    for best in search.best():
        for beam in best:
            beam.text = decode(beam.tokens) if decode is not None else ""
        outputs.append(BeamSearchOutput(best))
    return outputs


async def run_beam_search_async(
        search: BeamSearch, generate: Callable[[list[int], SamplingParams, str], AsyncIterator[RequestOutput]],
        request_id: str, prompt: str | None, decode: Callable[[list[int]], str] | None) -> RequestOutput:
    """The server's use_beam_search: one prompt, each step's beams as concurrent requests; one
    RequestOutput with a choice per beam (text: the generated tokens only, as vLLM's server)."""

    async def final(ids: list[int], rid: str) -> RequestOutput:
        stream = generate(ids, search.sampling_params, rid)
        try:
            last = None
            async for out in stream:
                last = out
            return last
        finally:
            await stream.aclose()  # cancelled (client gone, a sibling failed): aborts the request

    step = 0
    while not search.done:
        tasks = [asyncio.ensure_future(final(ids, f"{request_id}-beam{step}-{i}"))
                 for i, ids in enumerate(search.step_prompts())]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        search.advance([_candidates(o) for o in outs])
        step += 1
    best = search.best()[0]

    def texts() -> list[str]:
        return [decode(search.output_text_tokens(0, b)) if decode is not None else "" for b in best]

    for beam, text in zip(best, await asyncio.to_thread(texts)):
        beam.text = text
    return RequestOutput(
        request_id=request_id, prompt=prompt, prompt_token_ids=search.instances[0].prompt_token_ids,
        prompt_logprobs=None,
        outputs=[CompletionOutput(index=i, text=b.text, token_ids=search.output_tokens(0, b),
                                  cumulative_logprob=b.cum_logprob, logprobs=b.logprobs,
                                  finish_reason=b.finish_reason, stop_reason=b.stop_reason)
                 for i, b in enumerate(best)],
        finished=True)
