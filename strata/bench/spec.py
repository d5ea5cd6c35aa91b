"""`strata bench spec`: what speculative decoding buys on this machine, against the same engine
without it, in the same run.

Workloads (made locally, nothing downloaded):
    grounded  an instruction over a given text: passages of Python's own documentation (the
              standard library's docstrings, present wherever Python is) to be returned with any
              spelling fixed, so the answer re-uses the input (the editing / quoting case)
    chat      open questions with no text to copy from
Scenarios: `batch1` (one request at a time) and `concurrent` (--concurrency requests submitted at
once). Greedy, end of text respected, at most --output-len tokens: both sides produce the same tokens,
which the run checks. Each round measures the engine without speculation and with it
(`--speculative-algorithm` as given, ngram when none is) on prompts no earlier round used, so the
drafter's memory of recent requests carries no answers over. The two sides are one engine, its
speculator attached or not: they share its weights, KV pool and every other allocation (two engines
built one after the other in one process differ in their decode step by a few percent, from where
their memory landed, which would bias the ratio). The prefix cache is emptied before each run, so
each side prefills its prompts itself. At batch 1 the two take the round's prompts in turn, prompt by
prompt, alternating which goes first, so the slow and fast spells of a shared machine fall on both
alike; concurrent rounds alternate which goes first.

Reported per scenario: median output tok/s of each side, the median of the per-round ratios, the
pooled ratio (every round's output tokens over all their time, per side: a round's ratio depends
much on its prompts, the pooled one much less), and the accept length (tokens per verifying
request-step) and draft length the adaptive policy chose. Output tok/s is end to end: the round's
output tokens over the time its requests took, prefill included. Batch 1 also reports the decode
phase alone (tokens after the first over the time after the first, the per-stream rate a reader of a
streamed answer sees: speculation speeds up only this part, never the prompt's prefill), and what a
step costs by its rows (1: a decode, 1 + k: a verification of k drafts), each as a multiple of the
decode step without speculation: the ratio speculation has to beat.

With `--llamacpp` (llama-cpp-python installed) llama.cpp runs the batch-1 scenarios too, on the
default model's GGUF, without and with its prompt-lookup drafter (`LlamaPromptLookupDecoding`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import itertools
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

from strata.bench.step_timer import StepTimer, StepTiming
from strata.sampling_params import SamplingParams

# modules whose documentation the grounded workload quotes (all in the standard library)
DOC_MODULES = (
    "argparse",
    "asyncio",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "heapq",
    "http.client",
    "imaplib",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
)
GROUNDED_INSTRUCTION = (
    "Here is a passage from a program's documentation:\n\n{passage}\n\n"
    "Rewrite the passage above with any spelling mistakes corrected. Keep everything else exactly as it is."
)
LOOKUP_CONTEXT_LEN = (
    2048  # llama.cpp's context in this bench (prompts here stay below ~600 + output)
)
CHAT_TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "What are the pros and cons of {}?",
    "Give me five tips about {}.",
    "Write a poem about {}.",
    "Describe a day in the life of {}.",
)
CHAT_TOPICS = (
    "a lighthouse keeper",
    "learning to cook",
    "electric cars",
    "a robot gardener",
    "the ocean at night",
    "moving to a new city",
    "a lost umbrella",
    "volcanoes",
    "remote work",
    "an old library",
    "bees",
    "climbing a mountain",
    "the first day of school",
    "a chess tournament",
    "rainy Sundays",
    "bridges",
    "a jazz musician",
    "saving money",
    "the moon landing",
    "a small bakery",
    "winter in the north",
)


@dataclass(frozen=True)
class SpecBenchConfig:
    scenarios: tuple[str, ...] = (
        "grounded-batch1",
        "chat-batch1",
        "grounded-concurrent",
        "chat-concurrent",
    )
    batch1_prompts: int = (
        4  # requests per round in the batch-1 scenarios, one after another
    )
    concurrency: int = 64
    input_len: int = 320  # tokens of documentation per grounded prompt (about)
    output_len: int = 256
    rounds: int = 3
    llamacpp: bool = False


@dataclass
class ScenarioResult:
    scenario: str
    off_tok_s: list[float] = field(default_factory=list)  # per round
    on_tok_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    # batch 1: the decode phase alone (tokens after each request's first, over the time after it)
    off_decode_tok_s: list[float] = field(default_factory=list)
    on_decode_tok_s: list[float] = field(default_factory=list)
    decode_ratios: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    # per round: each side's output tokens and the seconds its requests took (for the pooled figures)
    off_output_tokens: list[int] = field(default_factory=list)
    off_seconds: list[float] = field(default_factory=list)
    on_seconds: list[float] = field(default_factory=list)
    accept_length: list[float] = field(default_factory=list)
    draft_length: list[float] = field(default_factory=list)
    # per round: calls of a draft model or block drafter, and the ms each took (what `strata plan`
    # charges a drafting step beside its verified rows)
    drafter_calls: list[int] = field(default_factory=list)
    drafter_ms: list[float] = field(default_factory=list)
    drafter_share: list[float] = field(default_factory=list)  # calls per verifying step
    # per round: request-steps fed no draft, the guard's stand-down (vetoed) and the policy's
    # (declined: no proposal worth its row, or none found)
    vetoed: list[int] = field(default_factory=list)
    declined: list[int] = field(default_factory=list)
    identical: bool = True
    llamacpp_off_tok_s: list[float] = field(default_factory=list)
    llamacpp_lookup_tok_s: list[float] = field(default_factory=list)
    # batch 1: the ms of each step without prefill, by its rows (1: a decode; 1 + k: a verification
    # of k drafts), with speculation on, and the off engine's one-row steps
    on_step_ms: dict[int, list[float]] = field(default_factory=dict)
    off_step_ms: list[float] = field(default_factory=list)

    def step_costs(self) -> dict | None:
        """Median step ms by rows (and how many), and each as a multiple of the off engine's decode
        step: what a verification costs against the step it replaces. None outside batch 1."""
        if not self.off_step_ms:
            return None
        base = statistics.median(self.off_step_ms)
        by_rows = {}
        for rows, ms in sorted(self.on_step_ms.items()):
            med = statistics.median(ms)
            by_rows[rows] = {"ms": med, "steps": len(ms), "vs_decode": med / base}
        return {"off_decode_ms": base, "on_by_rows": by_rows}

    def pooled(self) -> dict | None:
        """Every round's output tokens over all their time, per side, and on over off: the figure that
        moves least from run to run (a round's ratio depends much on its prompts). None without rounds."""
        if not self.off_seconds or not self.on_seconds:
            return None
        off = sum(self.off_output_tokens) / sum(self.off_seconds)
        on = sum(self.output_tokens) / sum(self.on_seconds)
        return {
            "off_tok_s": off,
            "on_tok_s": on,
            "ratio": on / off if off > 0 else None,
        }

    def summary(self) -> dict:
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "scenario": self.scenario,
            "off_tok_s": med(self.off_tok_s),
            "on_tok_s": med(self.on_tok_s),
            "ratio": med(self.ratios),
            "pooled": self.pooled(),
            "off_decode_tok_s": med(self.off_decode_tok_s),
            "on_decode_tok_s": med(self.on_decode_tok_s),
            "decode_ratio": med(self.decode_ratios),
            "accept_length": med(self.accept_length),
            "draft_length": med(self.draft_length),
            "drafter_calls": med(self.drafter_calls),
            "drafter_ms_per_call": med(self.drafter_ms),
            "drafter_calls_per_verify_step": med(self.drafter_share),
            "output_tokens_per_round": med(self.output_tokens),
            "identical_outputs": self.identical,
            "step_costs": self.step_costs(),
            "llamacpp_tok_s": med(self.llamacpp_off_tok_s),
            "llamacpp_lookup_tok_s": med(self.llamacpp_lookup_tok_s),
            "llamacpp_ratio": (
                statistics.median(
                    a / b
                    for a, b in zip(self.llamacpp_lookup_tok_s, self.llamacpp_off_tok_s)
                )
                if self.llamacpp_off_tok_s
                else None
            ),
            "rounds": asdict(self),
        }


def doc_passages(
    tokenizer,
    tokens: int,
    modules: tuple[str, ...] = DOC_MODULES,
    exclude: frozenset[str] = frozenset(),
) -> list[str]:
    """Passages of about `tokens` tokens from the documentation of these standard library modules,
    in a fixed order, leaving out the paragraphs in `exclude`."""
    seen, passages, current, size = set(exclude), [], [], 0
    for p in doc_paragraphs(modules):
        if p in seen:
            continue
        seen.add(p)
        current.append(p)
        size += len(tokenizer.encode(p, add_special_tokens=False))
        if size >= tokens:
            passages.append("\n\n".join(current))
            current, size = [], 0
    return passages


def doc_paragraphs(modules: tuple[str, ...]) -> list[str]:
    """The paragraphs (12 words or more) of these modules' docstrings and their public classes' and
    functions', in a fixed order (a docstring inherited by several may repeat)."""
    paragraphs: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (
                inspect.isclass(obj) or inspect.isfunction(obj)
            ):
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            paragraphs += [p.strip() for p in doc.split("\n\n") if len(p.split()) >= 12]
    return paragraphs


def chat_questions() -> list[str]:
    return [
        t.format(topic) for topic, t in itertools.product(CHAT_TOPICS, CHAT_TEMPLATES)
    ]


def prompts_for(kind: str, engine, cfg: SpecBenchConfig) -> list[list[int]]:
    """Every prompt the run may use, as token ids; rounds take disjoint slices."""
    if kind == "grounded":
        texts = [
            GROUNDED_INSTRUCTION.format(passage=p)
            for p in doc_passages(engine.tokenizer, cfg.input_len)
        ]
    else:
        texts = chat_questions()
    return [engine.chat_ids([{"role": "user", "content": t}]) for t in texts]


@dataclass
class RunTiming:
    outputs: list[list[int]]
    seconds: float  # the whole run
    decode_tokens: int = 0  # batch 1: tokens after each request's first output
    decode_seconds: float = 0.0  # batch 1: time after each request's first output

    @property
    def tok_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds

    @property
    def decode_tok_s(self) -> float | None:
        return (
            self.decode_tokens / self.decode_seconds
            if self.decode_seconds > 0
            else None
        )


def _stream_one(
    engine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], int, float]:
    """One request streamed: its tokens, and the tokens and seconds after its first output."""
    ids: list[int] = []
    first_at, first_n = None, 0
    for out in engine.stream(prompt, params):
        ids += out.new_token_ids
        if first_at is None and out.new_token_ids:
            first_at, first_n = time.perf_counter(), len(out.new_token_ids)
    if first_at is None:
        return ids, 0, 0.0
    return ids, len(ids) - first_n, time.perf_counter() - first_at


def _run(
    engine,
    prompts: list[list[int]],
    batch1: bool,
    output_len: int,
    steps: list[StepTiming] | None = None,
) -> RunTiming:
    """The outputs and what they took; `steps` collects each engine step's timing."""
    params = SamplingParams(temperature=0, max_new_tokens=output_len)
    with StepTimer(engine) if steps is not None else contextlib.nullcontext() as timer:
        start = time.perf_counter()
        if batch1:
            run = RunTiming([], 0.0)
            for p in prompts:
                ids, tokens, seconds = _stream_one(engine, p, params)
                run.outputs.append(ids)
                run.decode_tokens += tokens
                run.decode_seconds += seconds
        else:
            run = RunTiming(
                [r.token_ids for r in engine.generate(prompts, params)], 0.0
            )
        run.seconds = time.perf_counter() - start
    if timer is not None and steps is not None:
        steps.extend(timer.steps)
    return run


class Arm:
    """One side of the comparison: the engine with `speculator` attached (None: without speculation)."""

    def __init__(self, engine, speculator):
        self.engine = engine
        self.speculator = speculator

    @contextlib.contextmanager
    def active(self):
        """The engine as this side runs it, its prefix cache emptied (each side prefills for itself)."""
        scheduler = self.engine.scheduler
        saved = scheduler.set_speculator(self.speculator)
        try:
            self.engine.flush_cache()
            yield self.engine
        finally:
            scheduler.set_speculator(saved)


def _run_arm(
    arm: Arm,
    prompts: list[list[int]],
    batch1: bool,
    output_len: int,
    steps: list[StepTiming] | None = None,
) -> RunTiming:
    with arm.active() as engine:
        return _run(engine, prompts, batch1, output_len, steps)


def _run_interleaved(
    arms: dict[str, Arm],
    prompts: list[list[int]],
    output_len: int,
    steps: dict[str, list[StepTiming]],
    first: int,
) -> dict[str, RunTiming]:
    """Batch 1 on both sides prompt by prompt, the one going first alternating (from side `first` of
    `arms`): a shared machine's slow and fast spells, which last seconds, then fall on both alike
    instead of on one side's half of the round. Each side's timing sums its requests', as if run
    back to back."""
    names = list(arms)
    timings = {name: RunTiming([], 0.0) for name in names}
    for i, prompt in enumerate(prompts):
        for j in range(len(names)):
            name = names[(first + i + j) % len(names)]
            one = _run_arm(arms[name], [prompt], True, output_len, steps[name])
            t = timings[name]
            t.outputs += one.outputs
            t.seconds += one.seconds
            t.decode_tokens += one.decode_tokens
            t.decode_seconds += one.decode_seconds
    return timings


def run(
    cfg: SpecBenchConfig, engine_options: dict, progress=print
) -> list[ScenarioResult]:
    from strata.engine.engine import Engine

    algorithm = engine_options.get("speculative_algorithm") or "none"
    engine = Engine(
        **{
            **engine_options,
            "speculative_algorithm": "ngram" if algorithm == "none" else algorithm,
        }
    )
    spec = engine.scheduler.spec
    assert spec is not None  # the engine was built with a speculative algorithm
    arms = {"off": Arm(engine, None), "on": Arm(engine, spec)}
    # warm-up: kernels, the allocator, and the first forward of each shape (drafted steps have many)
    warm = engine.chat_ids(
        [
            {
                "role": "user",
                "content": "Repeat this line three times: the quick brown fox "
                "jumps over the lazy dog near the river bank.",
            }
        ]
    )
    for arm in arms.values():
        _run_arm(arm, [warm], True, 96)
    llama = _llamacpp(engine_options) if cfg.llamacpp else None
    pools = {kind: prompts_for(kind, engine, cfg) for kind in ("grounded", "chat")}
    cursor = dict.fromkeys(pools, 0)
    results = []
    for scenario in cfg.scenarios:
        kind, mode = scenario.split("-")
        batch1 = mode == "batch1"
        size = cfg.batch1_prompts if batch1 else cfg.concurrency
        result = ScenarioResult(scenario)
        for r in range(cfg.rounds):
            pool = pools[kind]
            prompts = [pool[(cursor[kind] + i) % len(pool)] for i in range(size)]
            cursor[kind] += size
            before = dict(spec.stats.as_dict())
            timings: dict[str, RunTiming] = {}
            steps: dict[str, list[StepTiming]] = {"off": [], "on": []}
            if batch1:
                timings = _run_interleaved(
                    arms, prompts, cfg.output_len, steps, first=r % 2
                )
            else:
                for which in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    timings[which] = _run_arm(
                        arms[which], prompts, False, cfg.output_len
                    )
            for s in steps["on"]:
                if s.no_prefill:
                    result.on_step_ms.setdefault(s.num_tokens, []).append(
                        1000.0 * s.duration_s
                    )
            result.off_step_ms += [
                1000.0 * s.duration_s for s in steps["off"] if s.no_prefill
            ]
            off_run, on_run = timings["off"], timings["on"]
            result.identical &= off_run.outputs == on_run.outputs
            result.output_tokens.append(sum(len(o) for o in on_run.outputs))
            result.off_output_tokens.append(sum(len(o) for o in off_run.outputs))
            result.off_seconds.append(off_run.seconds)
            result.on_seconds.append(on_run.seconds)
            result.off_tok_s.append(off_run.tok_s)
            result.on_tok_s.append(on_run.tok_s)
            result.ratios.append(result.on_tok_s[-1] / result.off_tok_s[-1])
            decode = ""
            if batch1 and off_run.decode_tok_s and on_run.decode_tok_s:
                result.off_decode_tok_s.append(off_run.decode_tok_s)
                result.on_decode_tok_s.append(on_run.decode_tok_s)
                result.decode_ratios.append(on_run.decode_tok_s / off_run.decode_tok_s)
                decode = (
                    f"; decode phase off {off_run.decode_tok_s:.1f}, on {on_run.decode_tok_s:.1f} "
                    f"(x{result.decode_ratios[-1]:.2f})"
                )
            after = spec.stats.as_dict()
            verify_steps = after["verify_steps"] - before["verify_steps"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            drafted = after["drafted_tokens"] - before["drafted_tokens"]
            result.accept_length.append(
                (accepted + verify_steps) / verify_steps if verify_steps else 0.0
            )
            result.draft_length.append(drafted / verify_steps if verify_steps else 0.0)
            result.vetoed.append(after["vetoed"] - before["vetoed"])
            result.declined.append(after["declined"] - before["declined"])
            calls = after["draft_calls"] - before["draft_calls"]
            if calls:
                result.drafter_calls.append(calls)
                result.drafter_ms.append(
                    (after["draft_seconds"] - before["draft_seconds"]) * 1e3 / calls
                )
                result.drafter_share.append(calls / max(verify_steps, 1))
            if llama is not None and batch1:
                for lookup, sink in (
                    (False, result.llamacpp_off_tok_s),
                    (True, result.llamacpp_lookup_tok_s),
                ):
                    sink.append(llama.run(prompts, cfg.output_len, lookup))
            progress(
                f"{scenario} round {r + 1}: off {result.off_tok_s[-1]:.1f} tok/s, on {result.on_tok_s[-1]:.1f} "
                f"tok/s (x{result.ratios[-1]:.2f}), accept length {result.accept_length[-1]:.2f}{decode}; "
                f"request-steps vetoed {result.vetoed[-1]}, declined {result.declined[-1]}"
            )
        results.append(result)
    return results


class _LlamaCpp:
    """llama.cpp (llama-cpp-python) on the default model's GGUF, with or without prompt lookup."""

    def __init__(self, gguf, threads: int | None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = (
            threads or os.cpu_count() or 1
        )  # as Strata's torch threads (llama-cpp-python's default: half)

        def make(draft):
            # verifying drafts reads every fed row's logits: llama-cpp-python keeps them only with
            # logits_all (n_ctx x vocab floats, so a smaller context than the other targets)
            return Llama(
                model_path=str(gguf),
                n_ctx=LOOKUP_CONTEXT_LEN,
                n_threads=threads,
                n_threads_batch=threads,
                draft_model=draft,
                logits_all=draft is not None,
                verbose=False,
            )

        self.plain = make(None)
        self.lookup = make(LlamaPromptLookupDecoding(num_pred_tokens=8))

    def run(self, prompts: list[list[int]], output_len: int, lookup: bool) -> float:
        llm = self.lookup if lookup else self.plain
        start, tokens = time.perf_counter(), 0
        for ids in prompts:
            llm.reset()
            out = llm.create_completion(
                prompt=ids, max_tokens=output_len, temperature=0.0
            )
            tokens += out["usage"]["completion_tokens"]
        return tokens / (time.perf_counter() - start)


def _llamacpp(engine_options: dict) -> _LlamaCpp:
    from strata.bench.llamacpp import gguf_path, missing_reason

    reason = missing_reason(need_server=False)
    if reason:
        raise SystemExit(f"--llamacpp: {reason}")
    return _LlamaCpp(
        gguf_path(engine_options.get("model")), engine_options.get("num_threads")
    )


def drafter_training(engine_options: dict) -> dict | None:
    """What the drafter served cost to train (`strata spec train`'s training.json: the budget per
    phase, steps, held-out accept length), when the run serves one that records it."""
    import json
    from pathlib import Path

    draft = engine_options.get("speculative_draft_model")
    if engine_options.get("speculative_algorithm") != "dspark" or not draft:
        return None
    path = Path(draft) / "training.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return {
        k: record.get(k)
        for k in ("budget_s", "steps", "held_out", "validation", "threads")
    }


def format_text(results: list[ScenarioResult], training: dict | None = None) -> str:
    lines = [
        (
            f"{'scenario':<22}{'off tok/s':>10}{'on tok/s':>12}{'ratio':>7}{'accept len':>11}{'draft len':>10}"
            f"{'same out':>9}{'llama.cpp':>10}{'+lookup':>9}"
        )
    ]
    for r in results:
        s = r.summary()
        llama = (
            f"{s['llamacpp_tok_s']:>10.1f}{s['llamacpp_lookup_tok_s']:>9.1f}"
            if s["llamacpp_tok_s"] is not None
            else f"{'-':>10}{'-':>9}"
        )
        lines.append(
            f"{r.scenario:<22}{s['off_tok_s']:>10.1f}{s['on_tok_s']:>12.1f}{s['ratio']:>7.2f}"
            f"{s['accept_length']:>11.2f}{s['draft_length']:>10.2f}{s['identical_outputs']!s:>9}{llama}"
        )
    for r in results:
        pooled = r.pooled()
        if pooled is not None and pooled["ratio"] is not None and len(r.ratios) > 1:
            lines.append(
                f"{r.scenario}: pooled over its {len(r.ratios)} rounds (all output tokens over all "
                f"their time) off {pooled['off_tok_s']:.1f} tok/s, on {pooled['on_tok_s']:.1f} "
                f"tok/s, ratio {pooled['ratio']:.3f}"
            )
    for r in results:
        s = r.summary()
        if s["decode_ratio"] is not None:
            lines.append(
                f"{r.scenario}: decode phase (after each first token) off {s['off_decode_tok_s']:.1f} tok/s, "
                f"on {s['on_decode_tok_s']:.1f} tok/s, ratio {s['decode_ratio']:.2f}"
            )
        if s["drafter_calls"]:
            lines.append(
                f"{r.scenario}: drafter calls per round {s['drafter_calls']:.0f}, "
                f"{s['drafter_ms_per_call']:.2f} ms each (medians)"
            )
    for r in results:
        costs = r.step_costs()
        if costs is not None:
            rows = ", ".join(
                f"{n}: {c['ms']:.2f} ({c['vs_decode']:.2f}x, {c['steps']})"
                for n, c in costs["on_by_rows"].items()
            )
            lines.append(
                f"{r.scenario}: decode step off {costs['off_decode_ms']:.2f} ms; on, by rows "
                f"(ms, x the off step, steps): {rows}"
            )
    if training is not None:
        budget = training.get("budget_s") or {}
        held = training.get("held_out") or {}
        accept = ", ".join(
            f"{k} {v['accept_length']:.2f}"
            for k, v in held.items()
            if v.get("accept_length") is not None
        )
        lines.append(
            f"drafter: trained here in {budget.get('total', 0.0) / 60:.1f} min "
            f"(answers {budget.get('answers', 0.0) / 60:.1f}, streams {budget.get('streams', 0.0) / 60:.1f}, "
            f"training {budget.get('training', 0.0) / 60:.1f}, evaluation {budget.get('evaluation', 0.0) / 60:.1f}), "
            f"{training.get('steps')} steps; held-out accept length at fixed blocks: {accept or '-'}"
        )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    d = SpecBenchConfig()
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=list(d.scenarios),
        choices=[
            f"{k}-{m}" for k in ("grounded", "chat") for m in ("batch1", "concurrent")
        ],
    )
    p.add_argument(
        "--batch1-prompts",
        type=int,
        default=d.batch1_prompts,
        help="requests per batch-1 round",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="requests per concurrent round",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=d.input_len,
        help="documentation tokens per grounded prompt",
    )
    p.add_argument(
        "--output-len", type=int, default=d.output_len, help="most tokens per answer"
    )
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument(
        "--llamacpp",
        action="store_true",
        help="also llama.cpp with and without prompt lookup (batch 1)",
    )


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    for name in ("batch1_prompts", "concurrency", "input_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    return SpecBenchConfig(
        scenarios=tuple(args.scenarios),
        batch1_prompts=args.batch1_prompts,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        rounds=args.rounds,
        llamacpp=args.llamacpp,
    )
