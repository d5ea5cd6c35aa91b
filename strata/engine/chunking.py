"""How much of a prompt a request feeds in one step: the rule the scheduler applies and the
planner's replica model (strata.plan.replica) mirrors. Plain integers, no torch."""

from __future__ import annotations


def prefill_piece(
    remaining: int, chunk: int, budget: int, batch_empty: bool, first_piece: bool
) -> int:
    """Prompt tokens to feed this step (0: none), of `remaining`, with `budget` tokens left in the step.

    With chunking (chunk > 0) a prompt goes in pieces of `chunk` tokens from where its computation
    starts, not cut to fit what is left of a step: a piece that does not fit waits for a later step.
    Only the step's first piece is cut to the budget when it must be (a budget below `chunk`, or many
    decodes), so prefill always progresses. With the default sizes no piece is ever cut, so a
    request's pieces do not depend on what shares its steps: the CPU kernels compute a prompt's rows
    the same however it is cut, and this keeps the per-request fallback paths (SDPA, the BLAS)
    invariant too. Without chunking the whole rest goes in one step; alone (`batch_empty`) it
    may exceed the budget."""
    if chunk > 0:
        n = min(remaining, chunk)
        return n if n <= budget else (min(n, budget) if first_piece else 0)
    return remaining if (remaining <= budget or batch_empty) else 0
