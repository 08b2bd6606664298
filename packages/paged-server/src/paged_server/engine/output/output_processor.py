"""After sampling: append the token, grow the text, check stop conditions,
and package what is new as a ``RequestOutput``.

Stop strings may span tokens, so text that could still turn out to be the
start of a stop string is held back (``longest stop - 1`` characters) and
released once it cannot be; the final output flushes the rest. Text is cut
just before the stop string. A stop token (``stop_token_ids``, or EOS unless
``ignore_eos``) stays in ``token_ids`` but adds no text. The stop string or
``stop_token_ids`` id that ended a sequence is its ``stop_reason`` (vLLM's).
"""

from __future__ import annotations

from collections.abc import Collection

from paged_server.engine.request.sequence import Sequence
from paged_server.engine.sample.logprobs import TokenLogprobs
from paged_server.outputs import RequestOutput


def commit_token(
    seq: Sequence,
    token_id: int,
    logprob: TokenLogprobs | None,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> None:
    """The half of a token that needs no text: its id and logprobs, and the
    stop conditions on ids (a stop token, EOS, ``max_tokens``,
    ``max_model_len``), so the scheduler knows at once whether it goes on."""
    params = seq.request.params
    token_ids = seq.token_ids
    token_ids.append(token_id)
    seq.new_token_ids.append(token_id)
    if logprob is not None:
        seq.logprobs.append(logprob.logprob)
        seq.new_logprobs.append(logprob.logprob)
        if params.logprobs:
            seq.new_top_logprobs.append(logprob.top)
    if _is_stop_token(seq, token_id, eos_token_ids):
        if token_id in params.stop_token_ids:  # vLLM: EOS leaves stop_reason None
            seq.stop_reason = token_id
        seq.finish("stop")
    # seq.num_generated, read inline (once per token on the host critical path)
    elif (n := len(token_ids)) - seq.num_prompt_tokens >= params.max_tokens or n >= max_model_len:
        seq.finish("length")


def add_token_text(seq: Sequence, token_id: int, eos_token_ids: Collection[int]) -> None:
    """The text half of a committed token: its text (none for a stop token
    unless ``include_stop_str_in_output``), cut at a stop string, which
    finishes the sequence; once it is finished, the text held back too.

    Raises whatever the detokenizer raises."""
    params = seq.request.params
    if _is_stop_token(seq, token_id, eos_token_ids):
        kept = seq.text_stream.add(token_id) if params.include_stop_str_in_output else ""
        _add_text(seq, kept + seq.text_stream.flush())
    elif not _add_text(seq, seq.text_stream.add(token_id)) and seq.is_finished:
        _add_text(seq, seq.text_stream.flush())  # max_tokens, max_model_len or a grammar
    if params.stop or seq.is_finished:  # else _add_text released it all
        release_text(seq)


def _is_stop_token(seq: Sequence, token_id: int, eos_token_ids: Collection[int]) -> bool:
    params = seq.request.params
    return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)


def _add_text(seq: Sequence, piece: str) -> bool:
    """Append detokenized text, cutting (and finishing) at a stop string
    (after it with ``include_stop_str_in_output``); whether it cut."""
    if not piece:
        return False
    old_len = len(seq.output_text)
    seq.output_text += piece
    params = seq.request.params
    if not params.stop:  # no text is held back: all of it streams now
        seq.new_text += piece
        seq.emitted_text_len = old_len + len(piece)
        return False
    cut = find_stop(seq.output_text, params.stop, old_len)
    if cut is None:
        return False
    hit = [s for s in params.stop if seq.output_text.startswith(s, cut)]
    seq.stop_reason = max(hit, key=len)
    if params.include_stop_str_in_output:
        cut += len(seq.stop_reason)
    seq.output_text = seq.output_text[:cut]
    seq.finish("stop")
    return True


def find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Index of the earliest stop string that ends after ``old_len`` (the
    text length before this token), or ``None``."""
    if not stops:
        return None
    start = max(0, old_len - max(map(len, stops)) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def release_text(seq: Sequence) -> None:
    """Move text that can no longer be part of a stop string to ``new_text``."""
    stops = seq.request.params.stop
    hold = 0 if seq.is_finished or not stops else max(map(len, stops)) - 1
    upto = max(seq.emitted_text_len, len(seq.output_text) - hold)
    seq.new_text += seq.output_text[seq.emitted_text_len : upto]
    seq.emitted_text_len = upto


def take_output(seq: Sequence) -> RequestOutput | None:
    """The delta since the last output of ``seq`` (``None`` if nothing is new);
    a finished sequence reports exactly one final output."""
    finished = seq.is_finished
    if finished:
        if seq.finish_reported:
            return None
        release_text(seq)
    elif not seq.new_token_ids and not seq.new_text:
        return None
    request = seq.request
    params = request.params
    prompt_logprobs = None
    if params.prompt_logprobs is not None and not seq.prompt_logprobs_reported:
        prompt_logprobs = request.prompt_logprobs
        seq.prompt_logprobs_reported = True
    out = RequestOutput(
        request_id=request.request_id,
        index=seq.index,
        new_token_ids=seq.new_token_ids,
        new_text=seq.new_text,
        new_logprobs=seq.new_logprobs if params.logprobs is not None else None,
        finished=finished,
        finish_reason=seq.finish_reason,
        error=seq.error,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_generated_tokens=seq.num_generated,
        arrival_time=request.arrival_time,
        first_token_time=request.first_token_time,
        new_top_logprobs=seq.new_top_logprobs if params.logprobs else None,
        prompt_logprobs=prompt_logprobs,
        cumulative_logprob=seq.cumulative_logprob,
        first_scheduled_time=request.first_scheduled_time,
        num_cached_tokens=request.num_cached_tokens,
        stop_reason=seq.stop_reason if finished else None,
        pooled=request.pooling.result if finished and request.pooling is not None else None,
    )
    seq.new_token_ids, seq.new_logprobs, seq.new_text = [], [], ""
    seq.new_top_logprobs = []
    seq.finish_reported = finished
    return out
