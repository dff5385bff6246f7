"""The demo's lift picture: the run's fixed-eval solve-rate curve (the base's rate as a line, the registered
checkpoint marked) above a few of the same items as the base and production answered them at the endpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PASSED_COLOR, FAILED_COLOR = "#1a7f37", "#cf222e"


@dataclass
class Example:
    """One item as a version answered it: the task's drawing of the answer, the answer, and its outcome."""
    image: Any
    answer: str
    passed: bool


def draw_lift(path: Path, *, title: str, curve: list[tuple[int, float]], pick: tuple[int, float] | None,
              solved: tuple[int, int, int], examples: list[tuple[str, Example, Example]]) -> Path:
    """`curve` (step, pass rate) starts at the base (step 0); `solved` is (base, production, items) at the
    endpoint; `examples` are (item id, the base's answer, production's). Writes a PNG to `path`."""
    columns = max(1, len(examples))
    figure = Figure(figsize=(3.2 * columns, 9.5), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(3, columns, height_ratios=[1.3, 1, 1])
    figure.suptitle(title)

    rates = figure.add_subplot(grid[0, :])
    steps = [step for step, _ in curve]
    rates.plot(steps, [rate for _, rate in curve], marker="o", label="fixed eval, greedy (tracked)")
    if curve:
        rates.axhline(curve[0][1], color="gray", linestyle="--", label=f"base: {curve[0][1]:.2f}")
    if pick is not None:
        rates.scatter([pick[0]], [pick[1]], s=160, facecolors="none", edgecolors=PASSED_COLOR, linewidths=2,
                      label=f"registered: step {pick[0]}, {pick[1]:.2f}", zorder=3)
    base_solved, production_solved, items = solved
    rates.set(xlabel="GRPO step", ylabel="solve rate", ylim=(0, 1),
              title=f"at the endpoint: base {base_solved}/{items}, production {production_solved}/{items}")
    rates.legend(loc="upper left")
    rates.grid(alpha=0.3)

    for column, (item_id, *answers) in enumerate(examples):
        for row, (who, example) in enumerate(zip(("base", "production"), answers), start=1):
            axes = figure.add_subplot(grid[row, column])
            axes.imshow(example.image)
            axes.set_xticks([])
            axes.set_yticks([])
            for spine in axes.spines.values():
                spine.set(color=PASSED_COLOR if example.passed else FAILED_COLOR, linewidth=3)
            verdict = "solves" if example.passed else "fails"
            answer = example.answer if len(example.answer) <= 40 else example.answer[:37] + "..."
            axes.set_title(f"{who} {verdict} item {item_id}\n{answer!r}", fontsize=9,
                           color=PASSED_COLOR if example.passed else FAILED_COLOR)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    return path
