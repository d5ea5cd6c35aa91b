"""PNG plots for `strata plan` (matplotlib, Agg backend; imported only when --plot is given)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.plan.cost_model import CostModel, Sample


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fit(model: CostModel, samples: list[Sample], out_dir: str) -> list[Path]:
    """Predicted vs measured time of every calibration sample (the fit's quality at a glance)."""
    plt = _plt()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    vec = model.vector
    measured = np.array([s.seconds for s in samples]) * 1000
    predicted = (
        np.array(
            [
                np.dot(s.features, vec) + s.requests * model.request_overhead_s
                for s in samples
            ]
        )
        * 1000
    )
    fig, ax = plt.subplots(figsize=(5.5, 5))
    kind_of = lambda s: s.what.split(":")[0] if ":" in s.what else s.what.split(" ")[0]  # noqa: E731
    for kind in sorted({kind_of(s) for s in samples}):
        idx = [i for i, s in enumerate(samples) if kind_of(s) == kind]
        ax.scatter(measured[idx], predicted[idx], s=10, label=kind)
    lim = [
        max(min(measured.min(), predicted.min()), 1e-2),
        max(measured.max(), predicted.max()),
    ]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured ms",
        ylabel="cost model ms",
        title="calibration fit",
    )
    ax.legend(fontsize=7)
    path = Path(out_dir) / "calibration_fit.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_result(result, out_dir: str) -> list[Path]:
    """TTFT and ITL distributions (CDFs) and per-worker utilisation of one simulation."""
    plt = _plt()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    recs = [r for r in result.records if r.ok]
    ttft = np.sort([r.ttft * 1000 for r in recs if r.ttft is not None])
    itl = np.sort([x * 1000 for r in recs for x in r.itls])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, values, name in ((axes[0], ttft, "TTFT"), (axes[1], itl, "ITL")):
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set(
            xlabel=f"{name} ms",
            ylabel="fraction of requests" if name == "TTFT" else "fraction of gaps",
            title=f"{name} (simulated)",
        )
        ax.grid(alpha=0.3)
    names = [w.name for w in result.workers]
    axes[2].bar(
        range(len(names)),
        [w.utilisation for w in result.workers],
        color=[
            "tab:orange" if w.role == "prefill" else "tab:blue" for w in result.workers
        ],
    )
    axes[2].set(
        ylim=(0, 1.05), ylabel="busy fraction", title=f"utilisation: {result.label}"
    )
    if len(names) <= 16:
        axes[2].set_xticks(range(len(names)), names, fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "simulation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_size(tried, slo, out_dir: str) -> list[Path]:
    """p99 TTFT and ITL of every candidate `strata plan size` simulated, against the SLO."""
    plt = _plt()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pd, marker, name in ((False, "o", "data-parallel"), (True, "s", "PD")):
        cs = [c for c in tried if bool(c.deployment.num_prefill) == pd]
        if not cs:
            continue
        axes[0].scatter(
            [c.cost for c in cs],
            [c.result.summary.ttft.p99_ms for c in cs],
            marker=marker,
            label=name,
        )
        axes[1].scatter(
            [c.cost for c in cs],
            [c.result.summary.itl.p99_ms for c in cs],
            marker=marker,
            label=name,
        )
    for ax, limit, name in (
        (axes[0], slo.ttft_p99_ms, "TTFT p99 ms"),
        (axes[1], slo.itl_p99_ms, "ITL p99 ms"),
    ):
        if limit is not None:
            ax.axhline(limit, color="r", ls="--", lw=0.8, label="SLO")
        ax.set(xlabel="cost (workers)", ylabel=name, yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
