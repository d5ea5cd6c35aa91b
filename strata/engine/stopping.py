"""When a request stops, after each token it appends: structured output complete (or broken), a
stop token, end of text, a stop string the detokenizer matched, max_new_tokens or the context's end.
Torch-free; the scheduler calls `stop_reason` and finishes the request with the reason."""

from __future__ import annotations

from strata.engine.request import Req


def stop_reason(req: Req, token: int, context_len: int) -> str | None:
    """The finish reason `token` gives req ("stop", "length", "error"), or None to go on. Records
    what matched on the request (`matched_stop`, `error`) and feeds its detokenizer."""
    p = req.params
    out_len = len(req.output_ids)
    if req.grammar is not None and (grammar_done := _grammar_reason(req, token)):
        return grammar_done
    may_stop = out_len >= p.min_new_tokens
    if may_stop and token in p.stop_token_ids:
        req.matched_stop = token
        return "stop"
    if may_stop and not p.ignore_eos and token in req.eos_token_ids:
        req.matched_stop = token
        return "stop"
    if req.detokenizer is not None:
        req.detokenizer.add(token)
        if req.detokenizer.matched_stop is not None:
            req.matched_stop = req.detokenizer.matched_stop
            return "stop"
    if out_len >= p.max_new_tokens or req.seq_len >= context_len:
        return "length"
    return None


def _grammar_reason(req: Req, token: int) -> str | None:
    """The finish reason structured output imposes after `token`, if any: "stop" once the grammar
    is complete (nothing but end of text may follow), "error" if the matcher broke."""
    grammar = req.grammar
    if grammar.error is not None:
        req.error = f"structured output failed: {grammar.error}"
        return "error"
    if not grammar.is_complete:
        return None
    if token in req.eos_token_ids or token in req.params.stop_token_ids:
        req.matched_stop = token
    elif req.detokenizer is not None:
        req.detokenizer.add(token)
    return "stop"
