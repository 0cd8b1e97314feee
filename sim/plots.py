"""Plots of one run (matplotlib, headless): TTFT CDF and nodes-used timeline."""

from __future__ import annotations

from pathlib import Path

from sim.build import SimOutcome


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(outcome: SimOutcome) -> tuple[list[float], list[float]]:
    """TTFT of served requests against the fraction of *all* requests (dropped ones never reach
    1.0, as in SLINFER Fig. 22)."""
    reqs = outcome.result.requests
    ttfts = sorted(r.ttft for r in reqs if r.ttft is not None and not r.dropped)
    n = max(1, len(reqs))
    return ttfts, [(i + 1) / n for i in range(len(ttfts))]


def write_plots(outcome: SimOutcome, out_dir: Path, title: str = "") -> list[Path]:
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    xs, ys = ttft_cdf(outcome)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, ys)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}")
    ax.grid(alpha=0.3)
    paths.append(out_dir / "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    tl = outcome.metrics.timeline
    fig, ax = plt.subplots(figsize=(7, 3))
    if tl:
        t = [p[0] for p in tl]
        ax.step(t, [p[1] for p in tl], where="post", label="CPU nodes used")
        ax.step(t, [p[2] for p in tl], where="post", label="GPU nodes used")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("nodes")
    ax.set_title(f"Nodes used {title}")
    ax.legend(loc="upper right")
    paths.append(out_dir / "nodes_used.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
