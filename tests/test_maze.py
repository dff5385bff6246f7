"""The maze task (pure logic): determinism, rendering, tolerant parsing, reward rule, BFS optimality,
the fixed eval sets' layouts, and the `visgym` SkyRL-gym env."""
from __future__ import annotations

import ast
import hashlib
import random
import string
from collections import deque

import numpy as np
import pytest

from tasks.maze import datasets as ds
from tasks.maze.env import (
    AGENT_RGB, CELL_PX, FEEDBACK_OK, FEEDBACK_WALL, STOP, TARGET_RGB, WALL_RGB, MazeEpisode, answer_text,
    demonstration, generate_maze, move, parse_action, random_walk, render, solve, walk_answer,
)

# Pinned once; a change means every eval score before it is no longer comparable.
EVAL_LAYOUT_SHA256 = {
    "maze_2d/easy": "025a29020dbea3dc4f90c71754d9f35d255e58217488a5df0ced7738308c415b",
    "maze_2d/local7": "cbf623d61b43d0d83b378da53195127c750d43e01d1836240e6c848efebd34c6",
}
# Pinned as well: the pictures every trained model and cached SFT base has seen (maze 0 of size 7, the agent at
# its start and at its goal).
RENDER_SHA256 = ("87fcdb0720c6dfb564d51023ae0a732b8ba68b169acb078d260d4f6e7b1cde35",
                 "341f77f519da97419ef0c1f18c9cd113c9f7b7780df5e4cfd5cd89f51fed8356")


@pytest.mark.parametrize("size", [5, 7, 9, 11])
def test_generation_is_deterministic_and_a_perfect_maze(size):
    for seed in range(20):
        maze = generate_maze(seed, size)
        assert maze == generate_maze(seed, size)
        assert all(len(row) == size for row in maze.rows) and len(maze.rows) == size
        assert set(maze.rows[0] + maze.rows[-1]) == {"#"} and all(r[0] == r[-1] == "#" for r in maze.rows)
        low, high = 1, size - 2
        assert {maze.start, maze.goal} in ({(low, low), (high, high)}, {(low, high), (high, low)})
        # A spanning tree over the open cells: connected, and edges = cells - 1 (exactly one path).
        open_cells = {(r, c) for r in range(size) for c in range(size) if maze.rows[r][c] == "."}
        edges = sum(1 for (r, c) in open_cells for d in (0, 3) if move(maze, (r, c), d) is not None)
        assert edges == len(open_cells) - 1
    assert len({generate_maze(s, size).rows for s in range(20)}) > 1


def test_generation_rejects_bad_arguments():
    for seed, size in [(-1, 9), (0, 8), (0, 3), ("1", 9), (1.0, 9), (True, 9)]:
        with pytest.raises(ValueError):
            generate_maze(seed, size)


@pytest.mark.parametrize("size", [9, 11])
def test_rendering_size_and_colors(size):
    maze = generate_maze(3, size)
    image = render(maze)
    assert image.shape == (size * CELL_PX, size * CELL_PX, 3) and image.dtype == np.uint8
    assert tuple(image[0, 0]) == WALL_RGB
    centre = lambda pos: image[pos[0] * CELL_PX + CELL_PX // 2, pos[1] * CELL_PX + CELL_PX // 2]  # noqa: E731
    assert tuple(centre(maze.start)) == AGENT_RGB and tuple(centre(maze.goal)) == TARGET_RGB
    moved = render(maze, agent=maze.goal)
    assert tuple(moved[maze.start[0] * CELL_PX + CELL_PX // 2, maze.start[1] * CELL_PX + CELL_PX // 2]) == (255, 255, 255)
    assert "A" in maze.ansi() and "T" in maze.ansi()


def test_rendering_is_pixel_for_pixel_what_models_were_trained_on():
    maze = generate_maze(0, 7)
    drawn = (render(maze), render(maze, agent=maze.goal))
    assert tuple(hashlib.sha256(image.tobytes()).hexdigest() for image in drawn) == RENDER_SHA256


def test_parse_action_accepts_visgym_tuples_and_skyrl_words():
    assert parse_action("('move', 0)") == ("move", 0)
    assert parse_action('("move", 3)') == ("move", 3)
    assert parse_action("('stop', 'stop')") == STOP
    assert parse_action("  Up ") == ("move", 1)
    assert parse_action("left.") == ("move", 2)
    assert parse_action("I go down first ('move', 1) then ('move', 3)") == ("move", 3)
    for bad in ["('move', 4)", "('move', -1)", "('jump', 1)", "move", "", "(", None, 3, ["right"], "('move', True)"]:
        assert parse_action(bad) is None


def test_parse_action_fuzz_never_raises():
    rng = random.Random(1234)
    alphabet = string.printable + "éλ\x00"
    pieces = ["('move', ", "('stop', 'stop')", "right", "up", ")", "(", "'", '"', "0", "3", "9", ",", " ", "\n",
              "move", "stop", "[", "{", "lambda", "__import__('os')", "1e9999", "*" * 40]
    episode = MazeEpisode(generate_maze(0, 9))
    for i in range(3000):
        if i % 2:
            text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        action = parse_action(text)
        assert action is None or action == STOP or (action[0] == "move" and action[1] in (0, 1, 2, 3))
        if action is None:
            result = MazeEpisode(episode.maze).step(text)
            assert result.reward == 0.0 and not result.done and result.feedback.startswith("Cannot parse action string")


def test_reward_only_for_stopping_on_the_goal():
    maze = generate_maze(5, 9)
    path = solve(maze)
    # Stopping anywhere else: reward 0, episode over.
    early = MazeEpisode(maze)
    early.step(f"('move', {path[0]})")
    assert early.step("('stop', 'stop')").reward == 0.0 and early.done and not early.solved
    # Reaching the goal does not end the episode or pay; only the stop does.
    episode = MazeEpisode(maze)
    rewards = [episode.step(f"('move', {d})").reward for d in path]
    assert rewards == [0.0] * len(path) and not episode.done
    final = episode.step("('stop', 'stop')")
    assert final.reward == 1.0 and final.done and episode.solved and final.feedback == FEEDBACK_OK
    assert episode.step("('stop', 'stop')").reward == 0.0  # nothing after the end


def test_wall_move_is_an_invalid_move_not_an_exception():
    maze = generate_maze(2, 9)
    episode = MazeEpisode(maze)
    blocked = next(d for d in range(4) if move(maze, maze.start, d) is None)
    result = episode.step(f"('move', {blocked})")
    assert (result.reward, result.done, result.feedback) == (0.0, False, FEEDBACK_WALL)
    assert episode.agent == maze.start and episode.wall_bumps == 1


def _shortest_length(maze) -> int:
    """Independent check: breadth-first flood from the start over raw grid neighbours."""
    seen, frontier = {maze.start: 0}, deque([maze.start])
    while frontier:
        r, c = frontier.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if maze.rows[nr][nc] == "." and (nr, nc) not in seen:
                seen[(nr, nc)] = seen[(r, c)] + 1
                frontier.append((nr, nc))
    return seen[maze.goal]


@pytest.mark.parametrize("size", [5, 7, 9, 11])
def test_bfs_solver_is_optimal_and_valid(size):
    for seed in range(30):
        maze = generate_maze(seed, size)
        path = solve(maze)
        assert len(path) == _shortest_length(maze)
        assert walk_answer(maze, answer_text(path)).solved
        episode = MazeEpisode(maze)
        for action in demonstration(maze)[:-1]:  # VisGym appends stop twice
            episode.step(str(action))
        assert episode.solved
        assert ast.literal_eval(str(demonstration(maze)[-1])) == STOP


def test_single_turn_walk_rules():
    maze = generate_maze(7, 7)
    path = solve(maze)
    optimal = walk_answer(maze, answer_text(path))
    assert optimal.solved and optimal.final_distance == 0 and optimal.steps == len(path)
    no_stop = walk_answer(maze, " ".join(answer_text(path).split()[:-1]))
    assert not no_stop.solved and not no_stop.stopped and no_stop.final_distance == 0
    blocked = next(d for d in range(4) if move(maze, maze.start, d) is None)
    bump = walk_answer(maze, answer_text([blocked] + path))
    assert bump.bumped and not bump.solved and bump.steps == 0
    junk = walk_answer(maze, "right banana stop")
    assert not junk.solved and (junk.malformed or junk.bumped)


def test_eval_sets_are_pinned_by_layout_hash():
    for maze_set in (ds.skyrl_eval_set(), ds.local_eval_set(7)):
        assert maze_set.seeds == tuple(range(64))
        assert ds.layout_digest(maze_set.mazes()) == EVAL_LAYOUT_SHA256[maze_set.data_source]
    assert ds.skyrl_eval_set().data_source == "maze_2d/easy" and ds.skyrl_eval_set().size == 9


def test_built_datasets_keep_eval_layouts_and_never_train_on_them(tmp_path):
    spec = ds.DatasetSpec(skyrl_train_count=64, local_train_count=256, heldout_count=256)
    manifest = ds.build_datasets(tmp_path, spec)
    paths = ds.DatasetPaths(tmp_path)
    eval_rows = ds.read_rows(paths.skyrl_eval)
    assert {r["data_source"] for r in eval_rows} == {"maze_2d/easy"} and len(eval_rows) == 64
    # The hash recomputed from the parquet rows' layouts equals the generator's pinned hash.
    assert ds.layout_digest(ds.maze_from_layout(r["extra_info"]["layout"]) for r in eval_rows) == EVAL_LAYOUT_SHA256["maze_2d/easy"]
    local_eval = ds.read_rows(paths.local_eval)
    assert ds.layout_digest(ds.maze_from_layout(r["layout"]) for r in local_eval) == EVAL_LAYOUT_SHA256["maze_2d/local7"]
    assert manifest["eval_sets"]["maze_2d/local7"]["layout_sha256"] == EVAL_LAYOUT_SHA256["maze_2d/local7"]
    held = ds.read_rows(paths.local_heldout)
    assert len(held) == 256 and {r["data_source"] for r in held} == {"maze_2d/local7-heldout"}
    # Few 7x7 layouts exist (a 3x3 grid of cells): the held-out mazes are distinct and none is a fixed-eval one.
    held_layouts = {ds.layout_key(ds.maze_from_layout(r["layout"])) for r in held}
    assert len(held_layouts) == 256 and not held_layouts & {ds.layout_key(ds.maze_from_layout(r["layout"])) for r in local_eval}
    # Training never overlaps evaluation: seeds disjoint, and no eval/held-out layout in the local train set.
    eval_seeds = {r["seed"] for r in local_eval + held} | {r["extra_info"]["seed"] for r in eval_rows}
    train_local = ds.read_rows(paths.local_train)
    train_skyrl = ds.read_rows(paths.skyrl_train)
    assert not eval_seeds & ({r["seed"] for r in train_local} | {r["extra_info"]["seed"] for r in train_skyrl})
    banned = {(m["size"], tuple(m["rows"]), tuple(m["start"]), tuple(m["goal"]))
              for m in (ds.json.loads(r["layout"]) for r in local_eval + held)}
    for row in train_local:
        m = ds.json.loads(row["layout"])
        assert (m["size"], tuple(m["rows"]), tuple(m["start"]), tuple(m["goal"])) not in banned
        assert walk_answer(ds.maze_from_layout(row["layout"]), row["answer"]).solved


def test_visgym_env_runs_an_episode_through_skyrl_gym(tmp_path):
    import skyrl_gym

    from tasks.maze import MazeTask
    from training.skyrl_main import register_skyrl_env

    def register_visgym_env():
        register_skyrl_env(MazeTask(MazeTask.Options()))

    register_visgym_env()
    register_visgym_env()  # idempotent
    row = ds.skyrl_row(generate_maze(11, 9), "maze_2d/easy", "test")
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
    env = skyrl_gym.make("visgym", env_config={}, extras={**extras, "max_turns": 40})
    conversation, _ = env.init(row["prompt"])
    image_part = conversation[-1]["content"][0]
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("data:image/png;base64,")
    outputs = [env.step(f"('move', {d})") for d in solve(generate_maze(11, 9))]
    assert all(o["reward"] == 0.0 and not o["done"] for o in outputs)
    assert outputs[-1]["observations"][0]["content"][1]["text"] == FEEDBACK_OK
    last = env.step("stop")
    assert last["reward"] == 1.0 and last["done"] and last["observations"] == []
    metrics = env.get_metrics()
    assert metrics["solved"] == 1.0 and metrics["final_distance"] == 0
    # The turn cap ends an episode without a reward.
    capped = skyrl_gym.make("visgym", env_config={}, extras={**extras, "max_turns": 2})
    capped.init(row["prompt"])
    assert not capped.step("nonsense")["done"] and capped.step("nonsense")["done"]
    with pytest.raises(ValueError, match="seed"):
        skyrl_gym.make("visgym", env_config={}, extras={"extra_info": {"size": 9}})


def test_cli_data_build_writes_the_sets_and_validates_counts(tmp_path):
    from click.testing import CliRunner

    from rlops.cli import main

    env = {"RLOPS_DATA_DIR": str(tmp_path), "RLOPS_CONFIG": ""}
    runner = CliRunner()
    result = runner.invoke(main, ["data", "build", "--skyrl-train", "8", "--local-train", "8", "--heldout", "4"], env=env)
    assert result.exit_code == 0, result.output
    assert EVAL_LAYOUT_SHA256["maze_2d/easy"] in result.output
    assert len(ds.read_rows(tmp_path / "datasets" / "skyrl" / "train.parquet")) == 8
    bad = runner.invoke(main, ["data", "build", "--local-train", "0"], env=env)
    assert bad.exit_code != 0 and "--local-train" in bad.output


def test_random_walks_read_the_walls_and_guess_at_junctions():
    rng = random.Random(0)
    ends = set()
    for seed in range(30):
        maze = generate_maze(seed, 7)
        here, previous = maze.start, None
        for direction in random_walk(maze, rng):
            nxt = move(maze, here, direction)
            assert nxt is not None and nxt != previous  # never into a wall, never straight back
            previous, here = here, nxt
        options = [d for d in range(4) if move(maze, here, d) not in (None, previous)]
        assert here == maze.goal or not options  # ends on the target or in a dead end
        ends.add(here == maze.goal)
    assert ends == {True, False}  # some walks guess right, some do not
