"""Other packages use the scheduler only through its public API: no `scheduler._private` access,
no attributes assigned onto it, no methods swapped through its `__dict__` (strata/engine/hooks.py
holds the extension points instead); and those extension points behave as documented."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import strata
from strata.engine.hooks import ForwardObserver, StepObserver

ROOT = Path(strata.__file__).parent
SCHEDULER_NAMES = {"scheduler", "sched"}


def _is_scheduler(node: ast.AST, aliases: set[str]) -> bool:
    """`scheduler`, `sched`, `x.scheduler`, `self.engine.scheduler` or a name bound to one."""
    if isinstance(node, ast.Name):
        return node.id in SCHEDULER_NAMES or node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in SCHEDULER_NAMES


def _aliases(tree: ast.AST) -> set[str]:
    """Names assigned a scheduler anywhere in the module (`s = self.scheduler`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_scheduler(node.value, set()):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found += t.elts
        else:
            flat.append(t)
    return flat


def violations(source: str, rel: str) -> list[str]:
    """What in `source` (the module at strata/`rel`) reaches into a scheduler."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and _is_scheduler(node.value, aliases)
        ):
            found.append(f"{where}: reads the scheduler's private {node.attr!r}")
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _is_scheduler(t.value, aliases):
                found.append(f"{where}: sets or deletes the scheduler's {t.attr!r}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr", "vars")
            and node.args
            and _is_scheduler(node.args[0], aliases)
        ):
            found.append(f"{where}: {node.func.id}() on the scheduler")
    return found


def test_no_module_outside_the_engine_reaches_into_the_scheduler():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("engine/"):
            continue
        found += violations(path.read_text(), rel)
    assert not found, "use the scheduler's public API instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        # how PD, the step timer and calibration used to attach
        "def f(self, scheduler):\n    scheduler.disagg = self\n",
        "def f(self):\n    self.scheduler.before_release = self._on_release\n",
        "def f(self, rid):\n    self.scheduler._validate([rid], [], None)\n",
        "def f(self, req):\n    self.scheduler._finish(req, 'error')\n",
        "def f(engine):\n    sched = engine.scheduler\n    sched.step, sched.schedule = 1, 2\n",
        "def f(self):\n    self.scheduler.__dict__.pop('schedule', None)\n",
        "def f(engine):\n    s = engine.scheduler\n    s._alloc_for(None, 1)\n",
        "def f(engine):\n    setattr(engine.scheduler, 'schedule', None)\n",
    ],
)
def test_the_check_catches_each_way_in(source):
    assert violations(source, "disagg/manager.py")


def test_the_check_passes_public_use():
    source = (
        "def f(engine, rid):\n"
        "    s = engine.scheduler\n"
        "    s.validate_request([rid], [1], None)\n"
        "    engine.scheduler.add_observer(object())\n"
        "    return s.running, engine.scheduler.vocab_size\n"
    )
    assert violations(source, "bench/x.py") == []


# ----------------------------------------------------------------- the extension points


@pytest.fixture(scope="module")
def engine(llama_dir):
    from strata import Engine

    return Engine(model=str(llama_dir), dtype="float32", kv_cache_tokens=1024)


class _Recorder(StepObserver, ForwardObserver):
    def __init__(self):
        self.events: list[str] = []

    def on_step_start(self):
        self.events.append("step")

    def on_schedule_start(self):
        self.events.append("schedule")

    def on_scheduled(self, batch):
        self.events.append("batch" if batch is not None else "none")

    def on_forward_start(self, batch):
        self.events.append("forward")

    def on_piece_start(self, piece):
        self.events.append(piece)

    def on_forward_end(self, batch):
        self.events.append("forward-end")

    def on_results_start(self, batch):
        self.events.append("results")

    def on_results_end(self, batch):
        self.events.append(f"done:{sum(r.finished for r in batch.reqs)}")

    def on_step_end(self):
        self.events.append("end")


def test_observers_see_each_step_in_order_until_removed(engine):
    from strata import SamplingParams

    rec = _Recorder()
    engine.scheduler.add_observer(rec)
    engine.scheduler.runner.add_observer(rec)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0))
    finally:
        engine.scheduler.remove_observer(rec)
        engine.scheduler.runner.remove_observer(rec)
    step = ["step", "schedule", "batch", "forward", "prepare", "model", "logits"]
    step += ["forward-end", "results"]
    assert rec.events == [*step, "done:0", "end", *step, "done:1", "end"]
    seen = len(rec.events)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1, temperature=0))
    assert len(rec.events) == seen  # removed: told nothing more
    engine.scheduler.check_no_leaks()


class _Peer:
    def __init__(self):
        self.polls, self.released, self.transfers = 0, [], 1

    def poll(self):
        self.polls += 1

    def busy(self):
        return self.transfers > 0

    def before_release(self, req):
        self.released.append((req.rid, len(req.pages) > 0))


def test_a_peer_is_polled_keeps_steps_going_and_sees_kv_before_release(llama_dir):
    from strata import Engine, SamplingParams

    engine = Engine(model=str(llama_dir), dtype="float32", kv_cache_tokens=1024)
    peer = _Peer()
    engine.scheduler.attach_peer(peer)
    with pytest.raises(RuntimeError, match="already has"):
        engine.scheduler.attach_peer(_Peer())
    assert engine.has_work() and not engine.has_requests()  # only the transfer is left
    (rid,) = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=1))
    engine.step()
    assert peer.polls == 1 and peer.released == [(rid, True)]  # its pages still held
    peer.transfers = 0
    assert not engine.has_work()
    engine.scheduler.check_no_leaks()


def test_fail_request_reports_a_request_that_never_queued(engine):
    from strata import SamplingParams

    engine.scheduler.fail_request("lost", [5, 6], SamplingParams(), "no KV came")
    (out,) = engine.step()
    assert (out.rid, out.finished, out.finish_reason, out.error) == (
        "lost",
        True,
        "error",
        "no KV came",
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.scheduler.validate_request(["x"], [10**9], SamplingParams())
