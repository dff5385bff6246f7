"""Count the red squares among blue circles on a 3x3 grid, answered with one number.

Every picture is drawn from its seed (numpy only, 96x96: the tiny base's image size), so the eval set is
the same wherever it is built; the verifier reads the first number of the answer. Eval set `shapes/count`:
seeds 0..63; training pictures start at seed 100000 and skip every grid the eval set holds.
"""
from __future__ import annotations

import functools
import random
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rlops.task import Outcome, Task, TaskError, TaskItem

CELLS, CELL_PX = 3, 32
RED, BLUE, EMPTY = "R", "B", "."
RED_RGB, BLUE_RGB, BACKGROUND_RGB = (220, 30, 30), (30, 60, 220), (255, 255, 255)
EVAL_SOURCE = "shapes/count"
EVAL_SEEDS = range(0, 64)
TRAIN_SEED_START = 100_000
PROMPT = "How many red squares are in the picture? Answer with one number."
_NUMBER = re.compile(r"\d+")


class ShapesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_red: int = Field(5, ge=1, le=CELLS * CELLS, description="most red squares in a picture")
    correct_demonstrations: float = Field(0.5, ge=0, le=1, description="share of warm-start answers that are the "
                                          "right count; the rest are a neighbouring count, left for GRPO to fix")


def grid(seed: int, max_red: int) -> str:
    """The picture's 9 cells, row by row: red squares, blue circles (distractors) and empty cells."""
    rng = random.Random(seed)
    red = rng.randint(0, max_red)
    blue = rng.randint(0, CELLS * CELLS - red)
    cells = [RED] * red + [BLUE] * blue + [EMPTY] * (CELLS * CELLS - red - blue)
    rng.shuffle(cells)
    return "".join(cells)


def render(cells: str) -> np.ndarray:
    image = np.full((CELLS * CELL_PX, CELLS * CELL_PX, 3), BACKGROUND_RGB, dtype=np.uint8)
    yy, xx = np.mgrid[0:CELL_PX, 0:CELL_PX]
    circle = (yy - CELL_PX / 2 + 0.5) ** 2 + (xx - CELL_PX / 2 + 0.5) ** 2 <= (CELL_PX * 0.35) ** 2
    for i, cell in enumerate(cells):
        top, left = (i // CELLS) * CELL_PX, (i % CELLS) * CELL_PX
        block = image[top:top + CELL_PX, left:left + CELL_PX]
        if cell == RED:
            block[6:CELL_PX - 6, 6:CELL_PX - 6] = RED_RGB
        elif cell == BLUE:
            block[circle] = BLUE_RGB
    return image


def read_count(completion: str) -> int | None:
    match = _NUMBER.search(completion)
    return int(match.group()) if match else None


class ShapesTask(Task):
    name = "shapes"
    Options = ShapesOptions
    answer_length = 4

    def _item(self, seed: int) -> TaskItem:
        cells = grid(seed, self.options.max_red)
        return TaskItem(str(seed), PROMPT, functools.partial(render, cells), {"cells": cells, "count": cells.count(RED)})

    def eval_sets(self) -> list[str]:
        return [EVAL_SOURCE]

    def eval_items(self, data_source: str) -> list[TaskItem]:
        if data_source != EVAL_SOURCE:
            raise TaskError(f"the shapes task has no eval set {data_source!r} (it has {EVAL_SOURCE})")
        return [self._item(seed) for seed in EVAL_SEEDS]

    def train_items(self, count: int) -> list[TaskItem]:
        held_out = {grid(seed, self.options.max_red) for seed in EVAL_SEEDS}
        items, seed = [], TRAIN_SEED_START
        while len(items) < count:
            if grid(seed, self.options.max_red) not in held_out:
                items.append(self._item(seed))
            seed += 1
        return items

    def score(self, item: TaskItem, completion: str) -> Outcome:
        answered = read_count(completion)
        passed = answered == item.target["count"]
        return Outcome(item.id, passed, float(passed), {"count": item.target["count"], "answered": answered})

    def demonstration(self, item: TaskItem, rng: random.Random) -> str:
        count = item.target["count"]
        if rng.random() < self.options.correct_demonstrations:
            return str(count)
        return str(max(0, count + rng.choice((-1, 1))))

    def sample_columns(self, item: TaskItem, completion: str) -> dict[str, Any]:
        return {"count": item.target["count"], "answered": read_count(completion)}
