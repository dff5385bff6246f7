"""The Task seam: loading a task by path (and every way that fails), the shipped tasks' contracts, and the
import contract that keeps tracker/, registry_hooks/ and serving/ from knowing any task. No servers."""
from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlops.config import Config, ConfigError, load_config
from rlops.task import Task, TaskError, load_task, task_path
from tasks.maze import MazeTask
from tasks.maze.env import answer_text, solve, walk_answer
from tasks.maze.task import item_maze
from tasks.shapes import ShapesTask
from tasks.shapes.task import read_count

REPO = Path(__file__).resolve().parents[1]


class Incomplete(Task):
    name = "incomplete"

    def eval_sets(self):
        return []


@pytest.mark.parametrize(("path", "options", "message"), [
    ("tasks.maze", {}, "must be 'package.module:ClassName'"),
    ("tasks.nowhere:Task", {}, "cannot import 'tasks.nowhere'"),
    ("tasks.maze:Nope", {}, "has no Task subclass 'Nope'"),
    ("rlops.config:Config", {}, "has no Task subclass 'Config'"),
    ("test_tasks:Incomplete", {}, "does not implement demonstration, eval_items, score, train_items"),
    ("tasks.maze:MazeTask", {"eval_size": 6}, "task.options for tasks.maze:MazeTask: eval_size: .*odd"),
    ("tasks.maze:MazeTask", {"colour": "red"}, "task.options for tasks.maze:MazeTask: colour: Extra inputs"),
])
def test_a_task_that_cannot_load_names_the_key_and_what_is_wrong(path, options, message):
    with pytest.raises(TaskError, match=message):
        load_task(path, options)


def test_shipped_tasks_by_name_and_the_default():
    assert task_path("shapes") == "tasks.shapes:ShapesTask" and task_path("maze") == "tasks.maze:MazeTask"
    assert task_path("my.pkg:Counting") == "my.pkg:Counting"
    with pytest.raises(TaskError, match="shipped task's name"):
        task_path("../etc")
    assert isinstance(Config().load_task(), MazeTask)


def test_maze_keys_that_moved_say_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for env, where in (({"RLOPS_TRAINING__LOCAL__EVAL_SIZE": "9"}, "task.options.eval_size"),
                       ({"RLOPS_TRAINING__LOCAL__MAX_COMPLETION_TOKENS": "9"}, "task.options.answer_length"),
                       ({"RLOPS_TRACKING__SAMPLE_MAZES": "3"}, "tracking.sample_items")):
        with pytest.raises(ConfigError, match=where):
            load_config(None, environ=env)
    config = load_config(None, environ={"RLOPS_TASK__PATH": "tasks.shapes:ShapesTask",
                                        "RLOPS_TASK__OPTIONS": "{max_red: 3}"})
    assert config.load_task().options.max_red == 3
    with pytest.raises(ConfigError, match="task.path"):
        load_config(None, environ={"RLOPS_TASK__PATH": "not a path"})


def test_maze_task_scores_as_the_walk_does():
    task = MazeTask(MazeTask.Options())
    assert task.eval_sets() == ["maze_2d/local7", "maze_2d/local7-heldout", "maze_2d/easy"]
    items = task.eval_items("maze_2d/local7")
    assert [it.id for it in items] == [str(s) for s in range(64)]
    maze = item_maze(items[3])
    right = task.score(items[3], answer_text(solve(maze)))
    assert right.passed and right.score == 1.0 and right.extras["final_distance"] == 0
    assert not task.score(items[3], "left").passed and task.score(items[3], "left").row()["id"] == "3"
    assert walk_answer(maze, "up stop").solved == task.score(items[3], "up stop").passed
    with pytest.raises(TaskError, match="no eval set 'maze_2d/local9'"):
        task.eval_items("maze_2d/local9")
    message = items[0].messages()[0]["content"]
    assert message[0]["image_url"]["url"].startswith("data:image/png;base64,") and message[1]["type"] == "text"


def test_shapes_task_is_deterministic_verifiable_and_keeps_eval_out_of_training():
    task = ShapesTask(ShapesTask.Options())
    items = task.eval_items("shapes/count")
    again = ShapesTask(ShapesTask.Options()).eval_items("shapes/count")
    assert len(items) == 64 and task.items_digest(items) == task.items_digest(again)
    assert items[0].image().shape == (96, 96, 3)
    assert {it.target["count"] for it in items} == set(range(0, 6))  # every count 0..max_red occurs
    item = items[5]
    count = item.target["count"]
    assert task.score(item, f"{count}").passed and task.score(item, f" {count} squares").passed
    assert not task.score(item, f"{count + 1}").passed and not task.score(item, "many").passed
    assert task.score(item, "").extras == {"count": count, "answered": None} and read_count("a 12 b 3") == 12
    train = task.train_items(512)
    assert not {it.target["cells"] for it in train} & {it.target["cells"] for it in items}
    assert len({it.id for it in train}) == 512
    rng = random.Random(0)
    answers = [task.demonstration(item, rng) for _ in range(200)]
    assert str(count) in answers and all(abs(int(a) - count) <= 1 for a in answers)


def test_lint_imports_refuses_a_planted_wrong_way_import(tmp_path):
    """The contract is live: the tracker importing a task fails `lint-imports` (and passes without it)."""
    for package in ("rlops", "tracker", "registry_hooks", "serving", "training", "tasks"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    clean = subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout[-2000:]
    evals = tmp_path / "tracker" / "evals.py"
    evals.write_text(evals.read_text() + "\n\ndef _planted():\n    from tasks.maze import MazeTask  # noqa: F401\n")
    broken = subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0 and "tracker.evals -> tasks.maze" in broken.stdout, broken.stdout[-2000:]
