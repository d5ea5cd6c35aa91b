"""PNG plots with matplotlib's Agg backend (no display needed). matplotlib is optional: without
it, `--plot` fails with the line to install it.

    throughput_vs_concurrency.png   output tok/s and req/s against max concurrency (one line per target)
    ttft_distribution.png           TTFT histograms (one per run / target)
    itl_distribution.png            ITL histograms
    decode_step_vs_batch.png        one-batch: decode step time against batch size
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from strata.bench.one_batch import OneBatchResult
from strata.bench.serving import ServingResult

INSTALL_HINT = "pip install matplotlib==3.11.2"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(f"--plot needs matplotlib; {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(r: ServingResult) -> str:
    return f"conc={r.config.max_concurrency or 'inf'} rate={r.config.request_rate:g}"


def plot_serving(
    runs: Mapping[str, Sequence[ServingResult]], out_dir: str | Path
) -> list[Path]:
    """`runs`: target label -> its serving results (a sweep over concurrency / rate). Returns files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    sweeps = {t: [r for r in rs if r.config.max_concurrency] for t, rs in runs.items()}
    if any(len(rs) > 1 for rs in sweeps.values()):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for target, sweep in sweeps.items():
            rs = sorted(sweep, key=lambda r: r.config.max_concurrency or 0)
            xs = [r.config.max_concurrency for r in rs]
            ax1.plot(
                xs, [r.summary.output_throughput for r in rs], marker="o", label=target
            )
            ax2.plot(
                xs, [r.summary.request_throughput for r in rs], marker="o", label=target
            )
        for ax, name in (
            (ax1, "output tokens/s (whole run)"),
            (ax2, "requests/s (whole run)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        written.append(out / "throughput_vs_concurrency.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    for name, values_of, unit in (
        (
            "ttft",
            lambda r: [x.ttft for x in r.records if x.ok and x.ttft is not None],
            "TTFT (ms)",
        ),
        ("itl", lambda r: [g for x in r.records if x.ok for g in x.itls], "ITL (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for target, results in runs.items():
            for r in results:
                vals = [1000.0 * v for v in values_of(r)]
                if vals:
                    ax.hist(vals, bins=40, alpha=0.5, label=f"{target} {_label(r)}")
                    drawn = True
        if drawn:
            ax.set_xlabel(unit)
            ax.set_ylabel("count")
            ax.legend(fontsize=7)
            fig.tight_layout()
            written.append(out / f"{name}_distribution.png")
            fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def plot_one_batch(
    results: Sequence[OneBatchResult], out_dir: str | Path
) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for target in dict.fromkeys(r.target for r in results):
        rs = sorted(
            (r for r in results if r.target == target and r.decode_step_ms),
            key=lambda r: r.batch_size,
        )
        ax.plot(
            [r.batch_size for r in rs],
            [r.decode_step_ms for r in rs],
            marker="o",
            label=target,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step (ms, median)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "decode_step_vs_batch.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
