"""The maze as an rlops task: single-turn answers (`right right down stop`) walked from the start.

Eval sets: `maze_2d/local<eval_size>` (seeds 0..63, the local trainer's fixed set), its held-out set
(`-heldout`, new layouts) and SkyRL's `maze_2d/easy`. An item's target is the maze's layout, so a
scorer rebuilds the maze without regenerating it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
from typing import Any, Literal, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlops.task import Outcome, Task, TaskError, TaskItem
from tasks.maze import datasets as ds
from tasks.maze.env import (Maze, WalkResult, answer_moves, answer_text, random_walk, read_image, render, render_walk,
                            solve, walk_answer)
from tasks.maze.trajectories import eval_sample_columns


class MazeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    eval_size: int = Field(7, ge=5, description="maze size of the fixed eval set; GRPO trains on this size")
    train_sizes: list[int] = Field(default_factory=lambda: [5, 7], min_length=1,
                                   description="maze sizes of the supervised warm start's set")
    optimal_demonstrations: float = Field(0.0, ge=0, le=1, description="share of warm-start targets that are "
                                          "BFS-optimal answers; the rest are random walks that read the walls but "
                                          "guess at junctions")
    reward: Literal["task", "shaped"] = Field("task", description="GRPO's training reward: solved or not, or "
                                              "progress toward the target + a stop bonus")
    answer_length: int = Field(20, ge=2, description="most tokens of an answer (GRPO's completions, served evals)")

    @field_validator("train_sizes")
    @classmethod
    def _odd_sizes(cls, sizes: list[int]) -> list[int]:
        if any(s < 5 or s % 2 == 0 for s in sizes):
            raise ValueError(f"maze sizes must be odd and >= 5 (outer wall included), got {sizes}")
        return sizes

    @field_validator("eval_size")
    @classmethod
    def _odd_eval_size(cls, size: int) -> int:
        if size % 2 == 0:
            raise ValueError(f"eval maze size must be odd, got {size}")
        return size


def shaped_reward(result: WalkResult) -> float:
    """Solving pays 1.0; otherwise partial credit for getting closer (BFS distance) and for ending the
    answer with `stop`, minus a little per move past the target: without that penalty the policy learnt
    to stop ending its answers (seen here)."""
    if result.solved:
        return 1.0 - 0.05 * result.moves_past_goal
    progress = max(0.0, (result.start_distance - result.final_distance) / max(1, result.start_distance))
    return 0.5 * progress + (0.1 if result.stopped else 0.0) - 0.05 * result.moves_past_goal


def maze_item(maze: Maze) -> TaskItem:
    return TaskItem(str(maze.seed), ds.LOCAL_PROMPT, functools.partial(render, maze), maze.layout())


def item_maze(item: TaskItem) -> Maze:
    return ds.maze_from_layout(json.dumps(item.target))


class MazeTask(Task):
    name = "maze_2d"
    Options = MazeOptions
    skyrl_env_id = ds.ENV_CLASS
    skyrl_env_entry_point = "tasks.maze.skyrl_env:VisGymMazeEnv"

    def __init__(self, options: MazeOptions):
        super().__init__(options)
        self.answer_length = options.answer_length

    def _sets(self) -> dict[str, ds.MazeSet]:
        fixed, heldout = ds.local_eval_sets(self.options.eval_size)
        skyrl = ds.skyrl_eval_set()
        return {s.data_source: s for s in (fixed, heldout, skyrl)}

    def eval_sets(self) -> list[str]:
        return list(self._sets())

    def eval_items(self, data_source: str) -> list[TaskItem]:
        maze_set = self._sets().get(data_source)
        if maze_set is None:
            raise TaskError(f"the maze task has no eval set {data_source!r} (it has {', '.join(self._sets())}; "
                            f"task.options.eval_size names the local one)")
        return [maze_item(m) for m in maze_set.mazes()]

    def train_items(self, count: int) -> list[TaskItem]:
        """GRPO prompts: mazes of the eval size only. On the smaller ones the warm-started base is nearly
        always right, so half of all groups had identical rewards (no signal); on the eval size ~10% had."""
        size = self.options.eval_size
        return [maze_item(m) for m in ds.training_mazes([size], count, exclude=ds.local_eval_sets(size))]

    def demonstration_items(self, count: int) -> list[TaskItem]:
        return [maze_item(m) for m in ds.training_mazes(self.options.train_sizes, count,
                                                        exclude=ds.local_eval_sets(self.options.eval_size))]

    def demonstration(self, item: TaskItem, rng: random.Random) -> str:
        maze = item_maze(item)
        optimal = rng.random() < self.options.optimal_demonstrations
        return answer_text(solve(maze) if optimal else random_walk(maze, rng))

    def score(self, item: TaskItem, completion: str) -> Outcome:
        walk = walk_answer(item_maze(item), completion)
        return Outcome(item.id, walk.solved, float(walk.solved),
                       {"steps": walk.steps, "final_distance": walk.final_distance})

    def reward(self, item: TaskItem, completion: str) -> float:
        if self.options.reward == "shaped":
            return shaped_reward(walk_answer(item_maze(item), completion))
        return self.score(item, completion).score

    def sample_columns(self, item: TaskItem, completion: str) -> dict[str, Any]:
        return {"moves": " ".join(answer_moves(completion))}

    def request_item(self, image: np.ndarray, text: str) -> TaskItem | None:
        """A served maze is scored from its picture: the walls, start and goal are in the pixels."""
        maze = read_image(image)
        if maze is None:
            return None
        layout = maze.layout()
        digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]
        return TaskItem(f"served-{digest}", text, functools.partial(render, maze), layout)

    def illustrate(self, item: TaskItem, completion: str) -> np.ndarray:
        maze = item_maze(item)
        return render_walk(maze, walk_answer(maze, completion).cells)

    def skyrl_sample_columns(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        return eval_sample_columns(entry)
