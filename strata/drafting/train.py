"""`strata spec train`: a DSpark drafter (`strata.models.dspark`) for a target, trained on this
machine on the target's own answers (self-distillation; nothing downloaded).

Phases, each kept in the output directory so that a killed run resumes where it stopped:

  1. answers    the target's greedy answers to the training prompts (`strata.drafting.prompts`,
                none of them a bench prompt), through the engine in batches; appended to
                answers.jsonl as each batch finishes.
  2. streams    one prefill per batch of prompt + answer with the target's residual stream kept
                after the drafter's target layers (`Engine.layer_streams`); streams.pt (bf16).
  3. training   DeepSpec's DSpark objective (`strata.drafting.model`: the drafter in training and
                its loss), read for greedy verification: per sequence, anchors
                drawn among the answer's positions; each anchor's block (its token, then mask
                tokens) attends to the context rows before it and to its own block; the Markov head
                is teacher-forced (each row's previous token is the true one). The loss is the
                cross-entropy of each block row's logits against the target's token, weighted by
                exp(-row / gamma), plus the confidence head's binary cross-entropy against whether
                the row's greedy draft is the target's token (a greedy verifier accepts exactly
                that; DeepSpec's soft target, one minus the total variation between the two
                distributions, is what a sampling verifier accepts). AdamW, warm-up then cosine
                decay over the step count, which a time budget fixes after the first steps are
                timed. state.pt is written every --checkpoint-every seconds.
  4. export     config.json and model.safetensors in DeepSpec's layout (its frozen embedding and
                head copies included), training.json (the budget spent per phase, the metrics), and
                training.png (loss and accept length over the steps).
  5. held out   the drafter serving the bench's prompts (never trained on): fixed-length blocks,
                the mean accept length per workload.

The accept length of a block, measured during training on held-out sequences, is 1 plus the number
of its leading rows whose greedy draft is the target's token: what a greedy verifier yields for that
block when the context rows are the ones the server computes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from strata.drafting.config import TrainConfig
from strata.drafting.model import (
    DSparkTrainModel,
    block_loss,
    block_metrics,
    rope_for,
    target_tables,
)
from strata.model_config import ModelConfig
from strata.models.dspark import ARCHITECTURE

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
ANSWERS_FILE = "answers.jsonl"
PROMPTS_FILE = "prompts.json"
STREAMS_FILE = "streams.pt"
RECORD_FILE = "training.json"
PLOT_FILE = "training.png"


# ---------------------------------------------------------------------------- the phases


@dataclass
class Budget:
    """Seconds spent per phase (kept across resumes)."""

    answers: float = 0.0
    streams: float = 0.0
    training: float = 0.0
    evaluation: float = 0.0

    @property
    def total(self) -> float:
        return self.answers + self.streams + self.training + self.evaluation


@dataclass
class Sample:
    tokens: torch.Tensor  # [L] int64
    streams: torch.Tensor  # [L, n * hidden] bf16
    answer_start: int


@dataclass
class Progress:
    step: int = 0
    total_steps: int | None = None
    history: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)


def default_target_layers(num_layers: int, n: int = 4) -> tuple[int, ...]:
    """n layers spread from the second to the one before the last (DeepSpec's choice for Qwen3-4B
    is 1, 9, 17, 25, 33 of 36)."""
    last = num_layers - 2
    if last < 1:
        return (0,) if num_layers > 1 else (-1,)
    return tuple(sorted({round(1 + i * (last - 1) / max(n - 1, 1)) for i in range(n)}))


def default_mask_token(tokenizer, vocab_size: int, template_ids: set[int]) -> int:
    """An added token the chat template and the special roles do not use (its embedding only marks
    a row to fill); the vocabulary's last id where there is none."""
    added = {}
    getter = getattr(tokenizer, "get_added_vocab", None)
    if getter is not None:
        added = getter()
    used = template_ids | {
        i
        for i in (
            getattr(tokenizer, "bos_token_id", None),
            getattr(tokenizer, "eos_token_id", None),
            getattr(tokenizer, "pad_token_id", None),
        )
        if i is not None
    }
    free = sorted(i for i in added.values() if i not in used and i < vocab_size)
    return free[0] if free else vocab_size - 1


def draft_config(
    cfg: TrainConfig,
    target_raw: dict[str, Any],
    target_layers: tuple[int, ...],
    mask: int,
) -> dict[str, Any]:
    """The drafter's config.json: Qwen3's fields for its layers (the target's sizes and RoPE) and
    DeepSpec's DSpark fields."""
    text = target_raw.get("text_config") or target_raw
    heads = text["num_attention_heads"]
    raw = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_hidden_layers": cfg.draft_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads") or heads,
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "hidden_act": "silu",
        "max_position_embeddings": text.get("max_position_embeddings", 2048),
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.draft_layers,
        "torch_dtype": "float32",
        "target_layer_ids": list(target_layers),
        "num_target_layers": text["num_hidden_layers"],
        "block_size": cfg.block_size,
        "mask_token_id": mask,
        "num_anchors": cfg.anchors,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head,
        "enable_confidence_head": cfg.confidence_head,
        "confidence_head_with_markov": cfg.confidence_head and cfg.markov_rank > 0,
    }
    for key in (
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
    ):
        if key in text:
            raw[key] = text[key]
    return raw


class Trainer:
    """One `strata spec train` run over its output directory (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, engine_options: dict[str, Any], progress=None):
        self.cfg = cfg
        self.out = Path(cfg.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.engine_options = engine_options
        self.progress = progress or (lambda msg: logger.info("%s", msg))
        self.budget = Budget()
        self.started = time.monotonic()

    # ------------------------------------------------------------------ phases 1-2: data

    def data(self, engine) -> list[Sample]:
        from strata.drafting.prompts import training_prompts

        cfg = self.cfg
        key = cfg.data_key()
        prompts_path = self.out / PROMPTS_FILE
        stored = (
            json.loads(prompts_path.read_text()) if prompts_path.is_file() else None
        )
        if stored is None or stored.get("key") != key:
            for name in (ANSWERS_FILE, STREAMS_FILE):
                (self.out / name).unlink(missing_ok=True)
            texts = training_prompts(
                engine.tokenizer,
                cfg.chat_prompts,
                cfg.grounded_prompts,
                cfg.passage_tokens,
                cfg.seed,
            )
            from strata.sampling_params import SamplingParams

            params = SamplingParams(temperature=0, max_new_tokens=cfg.answer_len)
            kept, ids = [], []
            for t in texts:
                p = engine.chat_ids([{"role": "user", "content": t}])
                try:  # a passage of one long paragraph can outgrow a small model's context
                    engine.scheduler.check_fits(len(p), params)
                except ValueError:
                    continue
                kept.append(t)
                ids.append(p)
            if len(kept) < len(texts):
                self.progress(
                    f"{len(texts) - len(kept)} of {len(texts)} prompts left out: with "
                    f"{cfg.answer_len} answer tokens they do not fit the model's context"
                )
            stored = {"key": key, "texts": kept, "ids": ids}
            prompts_path.write_text(json.dumps(stored))
        prompts: list[list[int]] = stored["ids"]
        answers = self._answers(engine, prompts)
        return self._streams(engine, prompts, answers)

    def _answers(self, engine, prompts: list[list[int]]) -> list[list[int]]:
        from strata.sampling_params import SamplingParams

        path = self.out / ANSWERS_FILE
        done: dict[int, list[int]] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    done[row["i"]] = row["answer"]
        todo = [i for i in range(len(prompts)) if i not in done]
        params = SamplingParams(temperature=0, max_new_tokens=self.cfg.answer_len)
        start = time.monotonic()
        chunk = 64
        with (
            _bar(len(prompts), "answers", initial=len(done)) as bar,
            path.open("a") as f,
        ):
            for lo in range(0, len(todo), chunk):
                batch = todo[lo : lo + chunk]
                results = engine.generate([prompts[i] for i in batch], params)
                for i, r in zip(batch, results):
                    done[i] = r.choices[0].token_ids
                    f.write(json.dumps({"i": i, "answer": done[i]}) + "\n")
                f.flush()
                bar.update(len(batch))
        self.budget.answers += time.monotonic() - start
        return [done[i] for i in range(len(prompts))]

    def _streams(
        self, engine, prompts: list[list[int]], answers: list[list[int]]
    ) -> list[Sample]:
        path = self.out / STREAMS_FILE
        layers = self.target_layers
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if tuple(saved["layers"]) == layers and len(saved["tokens"]) == len(
                prompts
            ):
                return [
                    Sample(t, s, int(a))
                    for t, s, a in zip(
                        saved["tokens"], saved["streams"], saved["starts"]
                    )
                ]
        start = time.monotonic()
        seqs = [p + a for p, a in zip(prompts, answers)]
        samples: list[Sample] = []
        batch: list[int] = []
        limit = 4096  # tokens per prefill
        with _bar(len(seqs), "streams") as bar:
            for i in range(len(seqs)):
                batch.append(i)
                if (
                    i + 1 == len(seqs)
                    or sum(len(seqs[j]) for j in batch) + len(seqs[i + 1]) > limit
                ):
                    got = engine.layer_streams([seqs[j] for j in batch], layers)
                    for j, streams in zip(batch, got):
                        samples.append(
                            Sample(
                                torch.tensor(seqs[j], dtype=torch.int64),
                                streams.to(torch.bfloat16),
                                len(prompts[j]),
                            )
                        )
                    bar.update(len(batch))
                    batch = []
        torch.save(
            {
                "layers": list(layers),
                "tokens": [s.tokens for s in samples],
                "streams": [s.streams for s in samples],
                "starts": [s.answer_start for s in samples],
            },
            path,
        )
        self.budget.streams += time.monotonic() - start
        return samples

    # ------------------------------------------------------------------ phase 3: training

    def train(self, model: DSparkTrainModel, samples: list[Sample]) -> Progress:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        usable = [s for s in samples if len(s.tokens) - s.answer_start >= 2]
        if len(usable) < 2:
            raise ValueError(
                "too few answers of two or more tokens to train on; raise --answer-len or the prompts"
            )
        order = list(range(len(usable)))
        rng.shuffle(order)
        n_val = max(1, int(len(order) * cfg.validation_share))
        val = [usable[i] for i in order[:n_val]]
        train = [usable[i] for i in order[n_val:]]
        opt = torch.optim.AdamW(model.trainable(), lr=cfg.lr, weight_decay=0.0)
        progress = Progress(total_steps=cfg.steps)
        state_path = self.out / STATE_FILE
        if state_path.is_file():
            state = torch.load(state_path, weights_only=False)
            if state["config"] == self._train_key():
                model.load_state_dict(state["model"], strict=False)
                opt.load_state_dict(state["optimizer"])
                progress = Progress(**state["progress"])
                if cfg.steps is not None:
                    progress.total_steps = cfg.steps
                # the time spent before the kill, and this run's own on the data phases
                saved = Budget(**state["budget"])
                saved.answers += self.budget.answers
                saved.streams += self.budget.streams
                self.budget = saved
                rng.setstate(state["rng"])
                torch.set_rng_state(state["torch_rng"])
                self.progress(f"resuming at step {progress.step}")
        budget_s = cfg.time_budget_min * 60.0
        start = time.monotonic()
        spent_before = self.budget.training
        last_save = start
        paced = (progress.step, start)  # (step, time) the pace is measured from
        bar = _bar(progress.total_steps, "training", initial=progress.step)
        try:
            while progress.total_steps is None or progress.step < progress.total_steps:
                self._set_lr(opt, progress)
                opt.zero_grad(set_to_none=True)
                metrics: list[dict[str, float]] = []
                for _ in range(cfg.batch):
                    sample = train[rng.randrange(len(train))]
                    anchors = _anchors(sample, cfg.anchors, rng)
                    with self._autocast():
                        out = model(sample.streams.float(), sample.tokens, anchors)
                    loss, m = block_loss(
                        out, cfg.loss_decay_gamma, cfg.confidence_weight
                    )
                    (loss / cfg.batch).backward()
                    metrics.append(m)
                torch.nn.utils.clip_grad_norm_(model.trainable(), 1.0)
                opt.step()
                progress.step += 1
                row = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
                row["step"] = progress.step
                row["lr"] = opt.param_groups[0]["lr"]
                progress.history.append(row)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}", accept=f"{row['accept_length']:.2f}"
                )
                now = time.monotonic()
                self.budget.training = spent_before + now - start
                if cfg.steps is None and progress.step - paced[0] >= (
                    10 if progress.total_steps is None else 50
                ):
                    # the step count that fits the budget left at the pace of the last steps (a
                    # busy machine slows them; the schedule stretches or shrinks with it)
                    per_step = (now - paced[1]) / (progress.step - paced[0])
                    left = budget_s - self.budget.total - cfg.eval_reserve_min * 60.0
                    progress.total_steps = progress.step + max(1, int(left / per_step))
                    paced = (progress.step, now)
                    bar.total = progress.total_steps
                    bar.refresh()
                if progress.step % 100 == 0 or progress.step == progress.total_steps:
                    progress.validation.append(
                        {"step": progress.step, **self.validate(model, val)}
                    )
                if now - last_save >= cfg.checkpoint_every_s:
                    self._save_state(model, opt, progress, rng)
                    last_save = now
        finally:
            bar.close()
        self._save_state(model, opt, progress, rng)
        return progress

    @torch.no_grad()
    def validate(self, model: DSparkTrainModel, val: list[Sample]) -> dict[str, float]:
        """Accept length and loss over fixed anchors of the held-out sequences."""
        rng = random.Random(1234)
        hits_all, valid_all, losses = [], [], []
        for s in val:
            anchors = _anchors(s, self.cfg.anchors, rng)
            with self._autocast():
                out = model(s.streams.float(), s.tokens, anchors)
            loss, _ = block_loss(
                out, self.cfg.loss_decay_gamma, self.cfg.confidence_weight
            )
            losses.append(float(loss))
            labels = out["labels"]
            hits_all.append((out["logits"].argmax(-1) == labels) & (labels >= 0))
            valid_all.append(labels >= 0)
        m = block_metrics(torch.cat(hits_all), torch.cat(valid_all))
        return {"loss": sum(losses) / len(losses), **m}

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.use_bf16())

    def _set_lr(self, opt, progress: Progress) -> None:
        cfg = self.cfg
        total = progress.total_steps or 10**9
        warm = max(1, int(cfg.warmup * total))
        s = progress.step
        if s < warm:
            f = (s + 1) / warm
        else:
            f = 0.1 + 0.9 * 0.5 * (
                1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm)))
            )
        for g in opt.param_groups:
            g["lr"] = cfg.lr * f

    def _train_key(self) -> dict:
        keys = (
            "draft_layers",
            "block_size",
            "markov_rank",
            "markov_head",
            "confidence_head",
            "anchors",
            "batch",
            "lr",
            "seed",
        )
        return {
            **{k: getattr(self.cfg, k) for k in keys},
            "target_layers": list(self.target_layers),
            "data": self.cfg.data_key(),
        }

    def _save_state(self, model, opt, progress: Progress, rng: random.Random) -> None:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {
            "config": self._train_key(),
            "model": {k: v for k, v in model.state_dict().items() if k in trainable},
            "optimizer": opt.state_dict(),
            "progress": asdict(progress),
            "budget": asdict(self.budget),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        tmp = self.out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / STATE_FILE)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        from strata.engine.engine import Engine
        from strata.weights.default_model import resolve_model_path

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        engine = Engine(**self.engine_options)
        model_dir = resolve_model_path(engine.config.model)
        assert model_dir is not None  # the engine loaded from it
        target_config = cast(ModelConfig, engine.model.config)
        target_raw = json.loads((model_dir / "config.json").read_text())
        num_layers = target_config.num_layers
        self.target_layers = tuple(
            cfg.target_layers or default_target_layers(num_layers)
        )
        bad = [i for i in self.target_layers if not -1 <= i < num_layers - 1]
        if bad or list(self.target_layers) != sorted(set(self.target_layers)):
            raise ValueError(
                f"--target-layers {list(self.target_layers)}: strictly increasing layers in "
                f"-1 .. {num_layers - 2} (the target has {num_layers}; -1: its embeddings)"
            )
        template = set(engine.chat_ids([{"role": "user", "content": "x"}]))
        mask = cfg.mask_token_id
        if mask is None:
            mask = default_mask_token(
                engine.tokenizer, target_config.vocab_size, template
            )
        raw = draft_config(cfg, target_raw, self.target_layers, mask)
        samples = self.data(engine)
        self.vocab_record = write_draft_vocab(self.out, samples, cfg.draft_vocab)
        embed, head = target_tables(engine.model)
        del engine
        model = DSparkTrainModel(raw, embed, head, rope_for(raw))
        model.init_weights(cfg.seed)
        progress = self.train(model, samples)
        self.export(model, raw)
        record = self.record(progress, raw)
        self._plot(progress)
        eval_start = time.monotonic()
        record["held_out"] = self.evaluate()
        self.budget.evaluation = time.monotonic() - eval_start
        record["budget_s"] = asdict(self.budget) | {"total": self.budget.total}
        (self.out / RECORD_FILE).write_text(json.dumps(record, indent=2))
        return record

    def export(self, model: DSparkTrainModel, raw: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for name, t in model.state_dict().items():
            frozen = name in ("embed_tokens.weight", "lm_head.weight")
            tensors[name] = (t.to(torch.bfloat16) if frozen else t.float()).contiguous()
        save_file(tensors, str(self.out / "model.safetensors"))
        (self.out / "config.json").write_text(json.dumps(raw, indent=2))

    def record(self, progress: Progress, raw: dict[str, Any]) -> dict[str, Any]:
        last = progress.validation[-1] if progress.validation else {}
        return {
            "drafter": {
                k: raw[k]
                for k in (
                    "target_layer_ids",
                    "block_size",
                    "mask_token_id",
                    "markov_rank",
                    "markov_head_type",
                    "enable_confidence_head",
                    "num_hidden_layers",
                )
            },
            "steps": progress.step,
            "draft_vocab": self.vocab_record,
            "bf16_autocast": self.cfg.use_bf16(),
            "threads": torch.get_num_threads(),
            "sequences_per_step": self.cfg.batch,
            "anchors_per_sequence": self.cfg.anchors,
            "validation": last,
            "history_every_100": progress.history[::100],
            "validation_history": progress.validation,
        }

    def _plot(self, progress: Progress) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        hist = progress.history
        if not hist:
            return
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        steps = [h["step"] for h in hist]
        panels = (
            ("loss", "loss", "loss"),
            ("accept_length", "greedy accept length", "blocks"),
        )
        for ax, (key, ylabel, what) in zip(axes, panels):
            ax.plot(steps, _smooth([h[key] for h in hist]), label=f"training {what}")
            if progress.validation:
                ax.plot(
                    [v["step"] for v in progress.validation],
                    [v[key] for v in progress.validation],
                    "o-",
                    label=f"held-out {what}",
                )
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.legend()
        fig.tight_layout()
        fig.savefig(self.out / PLOT_FILE, dpi=120)
        plt.close(fig)

    def evaluate(self) -> dict[str, Any]:
        """The drafter serving the bench's prompts (held out): fixed-length blocks, greedy."""
        from strata.bench.spec import SpecBenchConfig, prompts_for
        from strata.engine.engine import Engine
        from strata.sampling_params import SamplingParams

        cfg = self.cfg
        if cfg.eval_prompts <= 0:
            return {}
        engine = Engine(
            **{
                **self.engine_options,
                "speculative_algorithm": "dspark",
                "speculative_draft_model": str(self.out),
                "speculative_fixed_length": True,
                "speculative_num_draft_tokens": cfg.block_size,
            }
        )
        bench = SpecBenchConfig()
        out = {}
        room = engine.scheduler.context_len - cfg.eval_answer_len
        for kind in ("grounded", "chat"):
            fits = [p for p in prompts_for(kind, engine, bench) if len(p) <= room]
            prompts = fits[: cfg.eval_prompts]
            if not prompts:
                out[kind] = {"prompts": 0, "accept_length": None, "verify_steps": 0}
                continue
            spec = engine.scheduler.spec
            assert spec is not None  # built with a speculative algorithm
            before = spec.stats.as_dict()
            engine.generate(
                prompts,
                SamplingParams(temperature=0, max_new_tokens=cfg.eval_answer_len),
            )
            after = spec.stats.as_dict()
            steps = after["verify_steps"] - before["verify_steps"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            out[kind] = {
                "prompts": len(prompts),
                "accept_length": (accepted + steps) / steps if steps else None,
                "verify_steps": steps,
            }
            self.progress(
                f"held-out {kind}: accept length {out[kind]['accept_length']}"
            )
        engine.close()
        return out


def write_draft_vocab(out: Path, samples: list[Sample], size: int) -> dict | None:
    """The `size` tokens most frequent in the answers, as the drafter's draft vocabulary
    (`strata.models.dspark.DRAFT_VOCAB_FILE`; none written for 0). Returns its size and the share
    of answer tokens it covers."""
    from collections import Counter

    from strata.models.dspark import DRAFT_VOCAB_FILE

    path = out / DRAFT_VOCAB_FILE
    if size <= 0:
        path.unlink(missing_ok=True)
        return None
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.tokens[s.answer_start :].tolist())
    ids = sorted(t for t, _ in counts.most_common(size))
    total = sum(counts.values())
    covered = sum(counts[t] for t in ids)
    path.write_text(json.dumps({"ids": ids}))
    return {
        "size": len(ids),
        "answer_token_coverage": covered / total if total else 0.0,
    }


def _anchors(sample: Sample, n: int, rng: random.Random) -> torch.Tensor:
    """Up to n distinct anchor positions whose token and next token are the answer's."""
    lo, hi = sample.answer_start, len(sample.tokens) - 2
    picks = rng.sample(range(lo, hi + 1), min(n, hi - lo + 1))
    return torch.tensor(sorted(picks), dtype=torch.int64)


def _smooth(xs: list[float], k: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _bar(total, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        initial=initial,
        unit="step" if desc == "training" else "seq",
        dynamic_ncols=True,
    )
