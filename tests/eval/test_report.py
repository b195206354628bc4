"""The eval report's figures stay readable: no title under a bar label, no legend over a data point, whole-number
draft positions."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mtptrain.eval.report import acceptance_figure, speedup_figure, tau_vs_k_figure  # noqa: E402


def row(label, method, k=0, budget=None, tau=1.0, speedup=1.0, acceptance=()):
    return {"label": label, "method": method, "k": k, "budget": budget, "tau": tau, "speedup": speedup,
            "acceptance": list(acceptance)}


def near_one_results() -> dict:
    """Speedups just under 1.0, so the baseline's 1.00x bar is the tallest; tree points in the upper-left corner
    (tau and speedup both falling with the budget), where a corner legend sits."""
    methods = [row("baseline", "baseline"),
               row("ngram K=2", "ngram", 2, tau=1.10, speedup=0.97, acceptance=[0.30, 0.12]),
               row("ngram K=3", "ngram", 3, tau=1.12, speedup=0.95, acceptance=[0.30, 0.12, 0.05]),
               row("chain K=2", "chain", 2, tau=1.60, speedup=0.99, acceptance=[0.45, 0.20]),
               row("chain K=3", "chain", 3, tau=1.70, speedup=0.96, acceptance=[0.45, 0.20, 0.08]),
               row("tree N=4", "tree", 4, 4, tau=2.50, speedup=0.98, acceptance=[0.6, 0.3, 0.1, 0.05]),
               row("tree N=8", "tree", 4, 8, tau=2.20, speedup=0.80, acceptance=[0.6, 0.3, 0.1, 0.05]),
               row("tree N=16", "tree", 4, 16, tau=1.90, speedup=0.60, acceptance=[0.6, 0.3, 0.1, 0.05])]
    return {"methods": methods, "best": {"ngram": "ngram K=2", "chain": "chain K=2", "tree": "tree N=4"}}


def one_large_results() -> dict:
    results = near_one_results()
    results["methods"][3] = row("chain K=2", "chain", 2, tau=2.9, speedup=2.4, acceptance=[0.8, 0.6])
    return results


def drawn(fig):
    """The figure as it is saved (eval.report._save lays it out before writing)."""
    fig.tight_layout()
    fig.canvas.draw()
    return fig.canvas.get_renderer()


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("results", [near_one_results(), one_large_results()], ids=["near-one", "one-large"])
def test_speedup_title_clears_every_bar_label(results):
    fig = speedup_figure(results)
    renderer = drawn(fig)
    (ax,) = fig.axes
    title = ax.title.get_window_extent(renderer)
    labels = [a for a in ax.texts if "x\ntau" in a.get_text()]
    assert len(labels) == 4
    for label in labels:
        box = label.get_window_extent(renderer)
        assert not box.overlaps(title), label.get_text()
        assert box.y1 <= ax.get_window_extent(renderer).y1, f"{label.get_text()!r} sticks out of the axes"


@pytest.mark.parametrize("figure, panels", [(tau_vs_k_figure, 3), (acceptance_figure, 1)])
def test_no_legend_hides_a_data_point_or_another_panel(figure, panels):
    fig = figure(near_one_results())
    renderer = drawn(fig)
    assert len(fig.axes) == panels
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        box = legend.get_window_extent(renderer)
        for line in ax.lines:
            points = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
            for x, y in points:
                assert not box.contains(x, y), f"{ax.get_title()}: the legend covers {line.get_label()} at ({x}, {y})"
        for other in fig.axes:
            if other is not ax:
                assert not box.overlaps(other.get_window_extent(renderer)), ax.get_title()


def test_acceptance_positions_are_whole_numbers_and_the_rate_is_called_cumulative():
    fig = acceptance_figure(near_one_results())
    drawn(fig)
    (ax,) = fig.axes
    ticks = ax.xaxis.get_majorticklocs()
    visible = [t for t in ticks if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert visible and all(float(t).is_integer() for t in visible), visible
    assert "cumulative" in ax.get_ylabel()
