"""The output processor: sampled tokens in, stream deltas and finished outputs out.

Job: what happens to a request after the model ran: each sampled token appended to its
sequence (the grammar's matcher advanced, the text detokenized incrementally), the stop
checks (stop token ids and EOS, stop strings, the grammar's end, max_tokens and
max_model_len), the step's ``EngineUpdate`` per request (deltas with held-back text, tool
call pieces), and for a finished request its ``RequestOutput``, finished-request stats,
tool-call counts and span. Scheduling is the engine core's: ``append_token`` says why a
sequence finished and the core releases it.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from prefixserve.common.tracing import RequestTiming, RequestTracer
from prefixserve.replica.contract.continuation import Continuation, ContinuationMismatchError
from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.core.request import Request, Sequence
from prefixserve.replica.engine.metrics import EngineMetrics, FinishedRequestStats
from prefixserve.replica.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class EngineUpdate:
    """What one step produced for one request."""

    request_id: str
    deltas: list[StreamDelta]
    # Set when the request finished in this step.
    output: RequestOutput | None = None
    # Set when the request failed in this step (it is gone from the engine, its blocks freed).
    error: Exception | None = None


class OutputProcessor:
    """Appends tokens, applies stop conditions and reports updates for one engine.

    ``tracer``: where finished requests' spans go (None: untraced).
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        eos_token_ids: Set[int],
        max_model_len: int,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tracer = tracer

    def append_token(
        self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float
    ) -> FinishReason | None:
        """Append a sampled token to ``seq``; why the sequence finishes with it, or None."""
        req, p = seq.request, seq.request.params
        if seq.grammar is not None:
            seq.grammar.accept(token)
        seq.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.observe_first_token(now - req.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.observe_inter_token(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        if self._stops(seq, token):
            if p.include_stop_str_in_output:  # vLLM then detokenizes the stop token too
                seq.text += seq.detok.add(token)
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.terminated:
            return FinishReason.STOP
        delta = seq.detok.add(token)
        if delta:
            seq.text += delta
            if p.stop and self._truncate_at_stop(seq, len(delta)):
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _stops(self, seq: Sequence, token: int) -> bool:
        """Whether ``token`` ends ``seq``: one of its stop token ids, or EOS unless it ignores EOS."""
        p = seq.request.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def replay(self, seq: Sequence, continuation: Continuation) -> None:
        """Put a continued stream's tokens into its new sequence (replica/contract/continuation.py) as if
        this engine had sampled them, and count what the client has as sent: the grammar's matcher, the
        text and its stop-string search, the tool-call parser and the logprobs' places stand where the
        first replica's stood, and the next update sends only what is new.

        ContinuationMismatchError when the tokens cannot be the stream's so far: the grammar refuses
        one, they already end the output, or their text is shorter than what the client was sent.
        No metric counts them (the first replica did).
        """
        p = seq.request.params
        for token in continuation.output_token_ids:
            if seq.grammar is not None:
                try:
                    seq.grammar.accept(token)
                except RuntimeError as exc:
                    raise ContinuationMismatchError(
                        f"the continued output does not follow its grammar: {exc}"
                    ) from None
            seq.token_ids.append(token)
            if self._stops(seq, token) or (seq.grammar is not None and seq.grammar.terminated):
                raise ContinuationMismatchError("the continued tokens end the output: nothing to continue")
            delta = seq.detok.add(token)
            if delta:
                seq.text += delta
                if p.stop and self._truncate_at_stop(seq, len(delta)):
                    raise ContinuationMismatchError("the continued text holds a stop string: nothing to continue")
        if continuation.emitted_chars > len(seq.text):
            raise ContinuationMismatchError(
                f"the client was sent {continuation.emitted_chars} characters but these tokens spell {len(seq.text)}"
            )
        seq.num_emitted_tokens = seq.num_output_tokens
        seq.num_emitted_chars = continuation.emitted_chars
        if seq.logprobs is not None:  # sent by the first replica; kept in place so the list lines up
            seq.logprobs.extend({} for _ in continuation.output_token_ids)
        if seq.tool_stream is not None:
            try:
                seq.tool_stream.resume(seq.text[: continuation.emitted_chars], continuation.tool_call_ids)
            except ValueError as exc:
                raise ContinuationMismatchError(str(exc)) from None

    @staticmethod
    def _truncate_at_stop(seq: Sequence, delta_len: int) -> bool:
        """Cut the text at the first stop string in it (after it with include_stop_str_in_output)."""
        params = seq.request.params
        stops = params.stop
        longest = max(len(s) for s in stops)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [(i, len(s)) for i, s in ((seq.text.find(s, search_from), s) for s in stops) if i >= 0]
        if not hits:
            return False
        start, length = min(hits)
        seq.text = seq.text[: start + length if params.include_stop_str_in_output else start]
        return True

    def update(self, req: Request, now: float) -> EngineUpdate:
        """The request's deltas since its last update; with its output (and metrics, span) once finished."""
        deltas = []
        num_output = req.num_output_tokens
        cached = req.num_cached_tokens or 0
        # A stop string the output keeps is never taken back: nothing to hold (vLLM's rule).
        holdback = 0 if req.params.include_stop_str_in_output else max((len(s) for s in req.params.stop), default=1) - 1
        for seq in req.seqs:
            new_tokens = seq.num_output_tokens - seq.num_emitted_tokens
            if new_tokens == 0 and not (seq.is_finished and seq.num_emitted_chars < len(seq.text)):
                continue
            # Text that might still turn into a stop string is held back until it cannot.
            upto = len(seq.text) if seq.is_finished else max(seq.num_emitted_chars, len(seq.text) - holdback)
            text = seq.text[seq.num_emitted_chars : upto]
            seq.num_emitted_chars = upto
            ids = seq.output_token_ids[seq.num_emitted_tokens :]
            seq.num_emitted_tokens = seq.num_output_tokens
            lps = seq.logprobs[-len(ids) :] if seq.logprobs is not None and ids else None
            # The request's first delta carries its prompt_logprobs (complete by then).
            prompt_lps = req.prompt_logprobs if not req.prompt_logprobs_sent else None
            prompt_ids = list(req.prompt_token_ids) if prompt_lps is not None else None
            prompt_ranks = req.prompt_logprob_ranks if prompt_lps is not None else None
            req.prompt_logprobs_sent = True
            delta = StreamDelta(
                request_id=req.request_id,
                index=seq.index,
                text=text,
                token_ids=ids,
                finish_reason=seq.finish_reason,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=cached,
                num_output_tokens=num_output,
                logprobs=lps,
                prompt_logprobs=prompt_lps,
                prompt_token_ids=prompt_ids,
                prompt_logprob_ranks=prompt_ranks,
                cache_retention=req.cache_retention,
            )
            if seq.tool_stream is not None:
                tools = seq.tool_stream.feed(
                    text, finished=seq.is_finished, truncated=seq.finish_reason == FinishReason.LENGTH
                )
                delta.content, delta.tool_calls = tools.content, list(tools.tool_calls) or None
                delta.tool_result = seq.tool_result = tools.result
            deltas.append(delta)
        output = None
        if req.finished:
            req.finished_time = now
            output = self.request_output(req)
            stats = self._finished_stats(req, now)
            self.metrics.observe_finished(stats)
            if req.tool_mode is not None:
                self.metrics.observe_tool_calls(*self._tool_counts(req))
            if self.tracer is not None:
                self._trace(req, stats)
        return EngineUpdate(req.request_id, deltas, output)

    @staticmethod
    def _finished_stats(req: Request, now: float) -> FinishedRequestStats:
        scheduled = req.scheduled_time if req.scheduled_time is not None else req.arrival_time
        first = req.first_token_time if req.first_token_time is not None else now
        reason = req.seqs[0].finish_reason if req.seqs and req.seqs[0].finish_reason else "stop"
        return FinishedRequestStats(
            finish_reason=str(reason),
            e2e_s=now - req.arrival_time,
            queued_s=scheduled - req.arrival_time,
            prefill_s=first - scheduled,
            decode_s=now - first,
            inference_s=now - scheduled,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=req.num_output_tokens,
            max_tokens=req.params.max_tokens,
            n=req.params.n,
        )

    @staticmethod
    def _tool_counts(req: Request) -> tuple[int, int]:
        """A finished request's parsed tool calls and its sequences whose tool-call text did not parse."""
        results = [s.tool_result for s in req.seqs if s.tool_result is not None]
        return sum(len(r.calls) for r in results), sum(r.failed for r in results)

    def _trace(self, req: Request, stats: FinishedRequestStats) -> None:
        assert self.tracer is not None
        start = req.arrival_time
        timing = RequestTiming(
            arrival=start,
            scheduled=start + stats.queued_s,
            first_token=start + stats.queued_s + stats.prefill_s,
            finished=start + stats.e2e_s,
        )
        p = req.params
        attributes: dict[str, Any] = {
            "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.num_generation_tokens,
            "prefixserve.cached_prompt_tokens": req.num_cached_tokens or 0,
            "gen_ai.request.n": p.n,
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.response.finish_reason": stats.finish_reason,
        }
        if p.structured_outputs is not None:
            attributes["prefixserve.structured_output.kind"] = p.structured_outputs.kind
        if req.tool_mode is not None:
            parsed, failures = self._tool_counts(req)
            attributes.update(
                {
                    "prefixserve.tool_choice": req.tool_mode.choice,
                    "prefixserve.tool_calls": parsed,
                    "prefixserve.tool_call_parse_failures": failures,
                }
            )
        self.tracer.record(req.request_id, timing, attributes, req.trace_headers)

    @staticmethod
    def request_output(req: Request) -> RequestOutput:
        """The RequestOutput of a request: every sequence's text, tokens and finish reason so far."""
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                logprobs=s.logprobs,
            )
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        e2e = None if req.finished_time is None else req.finished_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=outs,
            num_cached_tokens=req.num_cached_tokens or 0,
            ttft_s=ttft,
            e2e_s=e2e,
            prompt=req.prompt,
            prompt_logprobs=req.prompt_logprobs,
        )
