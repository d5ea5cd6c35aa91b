"""StepThreads: each size of step runs on the thread count its steps measure faster, and follows a
change in the machine's load; threads never change what the engine answers."""

from __future__ import annotations

import itertools

import pytest
import torch

from strata.engine.step_threads import StepThreads


def run(
    st: StepThreads, num_tokens: int, cost: dict[int, float], steps: int
) -> list[int]:
    """`steps` steps of `num_tokens` tokens whose time per step on t threads is cost[t]."""
    chosen = []
    for _ in range(steps):
        t = st.threads_for(num_tokens)
        st.record(num_tokens, t, cost[t])
        chosen.append(t)
    return chosen


def test_times_both_then_keeps_the_faster():
    st = StepThreads(2)
    chosen = run(st, 1, {1: 5e-3, 2: 8e-3}, 40)
    assert chosen[:2] == [2, 1]  # every core first, then one thread
    assert (
        chosen[2:10] == [1] * 8
    )  # one thread won: it stays, trying two only after the interval
    assert chosen.count(2) <= 4
    assert st.describe()["tokens 1"]["threads"] == 1


def test_size_classes_choose_apart():
    st = StepThreads(4)
    run(st, 1, {1: 5e-3, 4: 9e-3}, 20)
    run(st, 512, {1: 2.0, 4: 0.6}, 20)
    assert st.threads_for(1) == 1
    assert st.threads_for(512) == 4
    assert st.threads_for(700) == 4 and st.size_class(700) == st.size_class(512)


def test_larger_steps_skip_one_thread_trials_once_a_smaller_size_runs_on_all():
    """A burst of long prefills after decode steps that chose all threads never runs one of them on
    a single thread; below the crossover, trials go on."""
    st = StepThreads(2)
    assert run(st, 8, {1: 9e-3, 2: 5e-3}, 50).count(1) >= 1  # timed, lost
    for n in (256, 1024, 2048, 4096):
        assert run(st, n, {1: 2.0, 2: 1.0}, 300) == [2] * 300
    st = StepThreads(2)
    assert (
        run(st, 2048, {1: 2.0, 2: 1.0}, 50) == [2] * 50
    )  # a first prefill: no trial either
    run(st, 1, {1: 4e-3, 2: 5e-3}, 50)  # one thread wins for single tokens
    assert (
        run(st, 2, {1: 5e-3, 2: 6e-3}, 50).count(1) > 0
    )  # so the next size tries it too


def test_a_long_prompt_after_one_thread_decodes_runs_on_every_core():
    """One-token decodes that won on one thread let steps up to 4x larger try it, not a server's
    first 2048-token prompt."""
    st = StepThreads(2)
    run(st, 1, {1: 4e-3, 2: 5e-3}, 50)
    assert run(st, 2048, {1: 2.0, 2: 1.0}, 50) == [2] * 50
    assert run(st, 4, {1: 5e-3, 2: 6e-3}, 50).count(1) > 0  # two classes up: tried
    # four classes past the 4: not tried
    assert run(st, 64, {1: 0.1, 2: 0.06}, 50) == [2] * 50


def test_follows_a_change_of_load():
    """One thread wins on a busy machine (spinning threads lose their core); once the machine is
    quiet again, the periodic trial finds that all threads win and switches back."""
    st = StepThreads(2)
    quiet = {1: 6e-3, 2: 5e-3}
    busy = {1: 7e-3, 2: 170e-3}
    assert run(st, 1, quiet, 30)[-1] == 2
    busy_run = run(st, 1, busy, 600)
    assert busy_run[1:8] == [1] * 7  # one slow step is enough to leave all threads
    assert (
        busy_run.count(2) < 12
    )  # trials of the loser grow rare: their cost stays bounded
    assert run(st, 1, quiet, 1200)[-1] == 2


def test_trials_back_off_while_the_choice_holds():
    st = StepThreads(2, min_interval=8, max_interval=64)
    chosen = run(st, 4, {1: 1e-3, 2: 3e-3}, 2000)
    trials = [i for i, t in enumerate(chosen) if t == 2][1:]  # after the first timing
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert (
        gaps == sorted(gaps) and gaps[-1] == 65
    )  # 8, 16, 32, 64, 64, ... steps between trials


def test_one_thread_machine_never_switches():
    st = StepThreads(1)
    assert run(st, 64, {1: 1e-3}, 5) == [1] * 5
    assert st.describe() == {}


def test_rejects_zero_threads():
    with pytest.raises(ValueError, match="max_threads"):
        StepThreads(0)


@pytest.mark.parametrize("model", ["tiny-llama-float32", "default-q4", "default-bf16"])
def test_engine_answers_the_same_on_any_thread_count(model, request):
    """The forward's threads change between steps; the greedy tokens must not (every kernel keeps a
    row's arithmetic whatever the thread count). A governor that flips every step proves it, on a
    tiny model and on the default one (its real widths split across threads)."""
    from strata import Engine, SamplingParams

    if model.startswith("tiny"):
        path, options = request.getfixturevalue("llama_dir"), {"dtype": "float32"}
    else:
        path = request.getfixturevalue("default_dir")
        options = (
            {"quantization": "none", "dtype": "bfloat16"}
            if model.endswith("bf16")
            else {}
        )

    class Alternating(StepThreads):
        def threads_for(self, num_tokens: int) -> int:
            self.flip = not getattr(self, "flip", False)
            return 2 if self.flip else 1

    prompts = ["The quick brown fox", "Paged attention keeps", "Numbers 0123"]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    saved = torch.get_num_threads()
    try:
        plain = Engine(str(path), num_threads=2, step_threads="all", **options)
        expected = [r.token_ids for r in plain.generate(prompts, params)]
        plain.close()
        flipping = Engine(str(path), num_threads=2, **options)
        assert (
            flipping.scheduler.runner.step_threads is not None
        )  # on by default on a CPU
        flipping.scheduler.runner.step_threads = Alternating(2)
        assert [r.token_ids for r in flipping.generate(prompts, params)] == expected
        flipping.close()
    finally:
        torch.set_num_threads(saved)


def test_one_slow_step_is_not_a_neighbour():
    st = StepThreads(2)
    run(st, 1, {1: 6e-3, 2: 5e-3}, 5)
    assert run(st, 1, {1: 6e-3, 2: 12e-3}, 1) == [2]  # a collection or a page fault
    assert (
        st.threads_for(1) == 2
    )  # the average moved by a quarter of it: still within the margin
