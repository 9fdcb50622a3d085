"""PNG plots of the model. matplotlib is imported only when a plot is drawn: it is an optional
dependency (the ``bench`` extra) and may be missing, in which case :class:`PlottingUnavailable`
says so and the CLI prints that message instead of a PNG."""
from __future__ import annotations

from typing import Sequence

from flashflow.device import cdiv


class PlottingUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable("PNG output needs matplotlib, which is not installed "
                                  "(pip install matplotlib, or the 'bench' extra)") from None
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    return plt


def traffic_vs_cache(path: str, cache_sizes: Sequence[int], series: dict[str, Sequence[float]],
                     lower_bound: Sequence[float] | None = None, title: str = "") -> str:
    """One line per order: DRAM bytes read against cache size (both log scale)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = [c / 2**20 for c in cache_sizes]
    for label, values in series.items():
        ax.plot(mib, [v / 2**20 for v in values], marker="o", ms=3, label=label)
    if lower_bound is not None:
        ax.plot(mib, [v / 2**20 for v in lower_bound], "k--", lw=1, label="lower bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache size (MiB)")
    ax.set_ylabel("DRAM bytes read (MiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def order_heatmap(path: str, tiles_m: int, tiles_n: int, panels: dict[str, list],
                  arrows: bool = True, max_arrows: int = 400) -> str:
    """One panel per order: each tile coloured by when it runs, arrows from tile to tile."""
    plt = _pyplot()
    count = len(panels)
    cols = min(count, 3)
    rows = cdiv(count, cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows * tiles_m / max(tiles_n, 1)
                                                   + 0.6), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    for ax, (label, order) in zip(axes.flat, panels.items()):
        rank = [[float("nan")] * tiles_n for _ in range(tiles_m)]
        for i, (m, n) in enumerate(order):
            rank[m][n] = i
        im = ax.imshow(rank, cmap="viridis", origin="upper")
        if arrows and len(order) <= max_arrows:
            for (m0, n0), (m1, n1) in zip(order, order[1:]):
                ax.annotate("", xy=(n1, m1), xytext=(n0, m0),
                            arrowprops=dict(arrowstyle="->", color="white", lw=0.8, alpha=0.8))
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("n (B column-panel)")
        ax.set_ylabel("m (A row-panel)")
        fig.colorbar(im, ax=ax, fraction=0.046, label="issue step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def stair_steps(path: str, n_values: Sequence[int], times: Sequence[float],
                ideal: Sequence[float], title: str = "") -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(n_values, times, where="post", label="waves (model)")
    ax.plot(n_values, ideal, "k--", lw=1, label="tiles / slots (no tail)")
    ax.set_xlabel("N")
    ax.set_ylabel("time (tile run times)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
