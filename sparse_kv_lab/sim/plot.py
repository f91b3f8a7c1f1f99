"""The bench's timeline plot (`bench --plot FILE.png`): per layer, when prefill finished computing it, when its bytes
were posted and when they were in decode's blocks, for a bulk and a streaming run side by side. Needs matplotlib
(`pip install matplotlib`; `pip install -e './lab[plot]'` from this tree)."""

from __future__ import annotations

from typing import Any

from connector.core.errors import CliError
from sparse_kv_lab.sim.cluster import RequestResult


def layer_times(run: RequestResult) -> dict[int, tuple[float, float, float]]:
    """Global layer -> (computed, posted, landed), in ms from the start of compute. A layer in several batches
    (a block sent again once it filled) counts from its first post to its last landing."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for layers, _nbytes, posted, _written, landed, _chunks in run.timeline:
        for layer in layers:
            first[layer] = min(posted, first.get(layer, posted))
            last[layer] = max(landed, last.get(layer, landed))
    t0 = run.compute_start
    return {layer: ((run.layer_computed.get(layer, run.compute_end) - t0) * 1e3, (first[layer] - t0) * 1e3,
                    (last[layer] - t0) * 1e3) for layer in first}


MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install matplotlib (or run without --plot)"


def check_plotting() -> None:
    """Refuse --plot before a run when matplotlib is missing (a finished bench is not thrown away for it)."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(MATPLOTLIB_MISSING)


def plot_timeline(path: str, runs: dict[str, RequestResult], summary: dict[str, Any]) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise CliError(MATPLOTLIB_MISSING) from None
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 5), sharey=True, squeeze=False)
    for ax, (mode, run) in zip(axes[0], runs.items()):
        times = layer_times(run)
        layers = sorted(times)
        computed, posted, landed = ([times[layer][i] for layer in layers] for i in range(3))
        ax.hlines(layers, posted, landed, color="tab:blue", lw=2, label="posted -> in decode's blocks")
        ax.plot(computed, layers, "k|", ms=6, label="compute finished")
        ax.axvline((run.compute_end - run.compute_start) * 1e3, color="grey", ls="--", lw=1, label="prefill done")
        ax.axvline((run.last_complete - run.compute_start) * 1e3, color="tab:red", ls=":", lw=1,
                   label="decode complete")
        ax.set_title(f"{mode}: exposed {run.exposed_s * 1e3:.1f} ms")
        ax.set_xlabel("ms since prefill started computing")
        ax.legend(loc="lower right", fontsize=7)
    axes[0][0].set_ylabel("global layer")
    fig.suptitle(f"{summary['model']}, {summary['tokens']} tokens, {summary['device']}, staging "
                 f"{summary['staging_mb']} MiB, {summary['layer_ms']} ms/layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
