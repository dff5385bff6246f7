"""The maze datasets: SkyRL prompt rows for the production job and the local trainer's sets.

Seed plan (one place; training seeds never overlap evaluation seeds):
- eval sets use seeds 0..63, held-out checks the first n seeds from 1000 with new layouts, training seeds start at 100000;
- small mazes have few distinct layouts (a 7x7 has 768), so the local training set also drops every
  maze whose layout (grid, start, goal) appears in a local eval or held-out set.

Each eval set has its own `data_source` naming its maze size, and is pinned by `layout_digest` (a hash
of seed, grid, start and goal), which is identical wherever the set is built.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tasks.maze.env import LEVEL_SIZES, Maze, answer_text, generate_maze, solve

ENV_CLASS = "visgym"
EVAL_SEEDS = range(0, 64)
HELDOUT_SEED_START = 1000
TRAIN_SEED_START = 100_000

SYSTEM_PROMPT = (
    "You are an agent in a maze. The blue circle is the agent, the red square is the target, "
    "gray cells are walls. Answer with one action per turn: ('move', d) with d = 0 right, 1 up, 2 left, "
    "3 down, or ('stop', 'stop') when the agent is on the target."
)
USER_PROMPT = "Navigate the blue agent to the red target."
# Single-turn variant of the local trainer: the whole path in one answer.
LOCAL_PROMPT = "Move the blue agent to the red target. Answer with moves: right up left down, then stop."


@dataclass(frozen=True)
class MazeSet:
    """A named set of mazes: `data_source` is what metrics and best-checkpoint selection key on."""

    data_source: str
    size: int
    seeds: tuple[int, ...]

    def mazes(self) -> list[Maze]:
        return [generate_maze(seed, self.size) for seed in self.seeds]


def skyrl_eval_set() -> MazeSet:
    """SkyRL's VisGym eval set: seeds 0..63 of `maze_2d/easy` (9x9)."""
    return MazeSet("maze_2d/easy", LEVEL_SIZES["easy"], tuple(EVAL_SEEDS))


def local_eval_set(size: int = 7) -> MazeSet:
    return MazeSet(f"maze_2d/local{size}", size, tuple(EVAL_SEEDS))


@functools.lru_cache(maxsize=16)
def heldout_set(size: int = 7, count: int = 256) -> MazeSet:
    """`count` further eval mazes: the first seeds from HELDOUT_SEED_START whose layouts are new and not in
    the fixed local eval set. Consecutive seeds would repeat layouts: a 7x7 maze has a 3x3 grid of cells,
    so there are only a few hundred of them (256 seeds held 214 layouts, 17 of them fixed-eval ones)."""
    mazes = _scan_mazes(HELDOUT_SEED_START, [size], count, exclude=[local_eval_set(size)], distinct=True)
    return MazeSet(f"maze_2d/local{size}-heldout", size, tuple(m.seed for m in mazes))


def local_eval_sets(size: int = 7) -> list[MazeSet]:
    """The fixed local eval set and the held-out set: the layouts local training (SFT and GRPO) never sees."""
    return [local_eval_set(size), heldout_set(size)]


def layout_digest(mazes: Iterable[Maze | dict]) -> str:
    """sha256 over the canonical JSON of each maze's layout (seed, size, rows, start, goal), in order."""
    digest = hashlib.sha256()
    for maze in mazes:
        layout = maze.layout() if isinstance(maze, Maze) else maze
        digest.update(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def layout_key(maze: Maze) -> tuple:
    return (maze.size, maze.rows, maze.start, maze.goal)


def training_mazes(sizes: Iterable[int], count: int, exclude: Iterable[MazeSet] = ()) -> list[Maze]:
    """`count` training mazes cycling through `sizes`, seeds from TRAIN_SEED_START, skipping layouts of
    the `exclude` sets."""
    return _scan_mazes(TRAIN_SEED_START, sizes, count, exclude)


def _scan_mazes(first_seed: int, sizes: Iterable[int], count: int, exclude: Iterable[MazeSet] = (),
                distinct: bool = False) -> list[Maze]:
    """`count` mazes from consecutive seeds, cycling through `sizes`, skipping layouts of the `exclude` sets
    (and, if `distinct`, layouts already taken)."""
    sizes = list(sizes)
    if not sizes or count < 1:
        raise ValueError(f"need at least one maze size and count >= 1, got sizes={sizes} count={count}")
    banned = {layout_key(m) for maze_set in exclude for m in maze_set.mazes()}
    mazes: list[Maze] = []
    seed = first_seed
    while len(mazes) < count:
        maze = generate_maze(seed, sizes[len(mazes) % len(sizes)])
        seed += 1
        if layout_key(maze) not in banned:
            mazes.append(maze)
            if distinct:
                banned.add(layout_key(maze))
        if seed - first_seed > 100 * count + 10_000:
            raise ValueError(f"sizes {sizes}: too few layouts left outside the eval sets for {count} mazes")
    return mazes


# ------------------------------------------------------------------------------------------- rows


def skyrl_row(maze: Maze, data_source: str, split: str) -> dict:
    """One SkyRL prompt row. The image is not stored: the `visgym` env renders it in `init()` from the
    seed, and checks the stored layout against what it generates."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_PROMPT}],
        "env_class": ENV_CLASS,
        "reward_spec": {"method": "rule", "ground_truth": answer_text(solve(maze))},
        "extra_info": {"split": split, "id": str(maze.seed), "seed": maze.seed, "size": maze.size,
                       "layout": json.dumps(maze.layout(), sort_keys=True)},
    }


def local_row(maze: Maze, data_source: str) -> dict:
    """One local-trainer row: the maze, its BFS-optimal answer (the SFT target) and its layout."""
    return {"data_source": data_source, "seed": maze.seed, "size": maze.size,
            "answer": answer_text(solve(maze)), "layout": json.dumps(maze.layout(), sort_keys=True)}


def maze_from_layout(layout_json: str) -> Maze:
    data = json.loads(layout_json)
    return Maze(seed=data["seed"], size=data["size"], rows=tuple(data["rows"]),
                start=tuple(data["start"]), goal=tuple(data["goal"]))


# ------------------------------------------------------------------------------------------ build


@dataclass(frozen=True)
class DatasetPaths:
    root: Path

    @property
    def skyrl_train(self) -> Path:
        return self.root / "skyrl" / "train.parquet"

    @property
    def skyrl_eval(self) -> Path:
        return self.root / "skyrl" / "eval.parquet"

    @property
    def local_train(self) -> Path:
        return self.root / "local" / "train.parquet"

    @property
    def local_eval(self) -> Path:
        return self.root / "local" / "eval.parquet"

    @property
    def local_heldout(self) -> Path:
        return self.root / "local" / "heldout.parquet"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


@dataclass(frozen=True)
class DatasetSpec:
    """What `rlops data build` writes; the defaults are the recipe's."""

    skyrl_train_count: int = 4096
    local_sizes: tuple[int, ...] = (5, 7)
    local_eval_size: int = 7
    local_train_count: int = 2048
    heldout_count: int = 256


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def build_datasets(root: Path, spec: DatasetSpec = DatasetSpec()) -> dict:
    """Write every dataset under `root` and return the manifest (counts and eval layout digests)."""
    paths = DatasetPaths(Path(root))
    skyrl_eval = skyrl_eval_set()
    local_eval = local_eval_set(spec.local_eval_size)
    heldout = heldout_set(spec.local_eval_size, spec.heldout_count)
    easy = LEVEL_SIZES["easy"]
    skyrl_train = training_mazes([easy], spec.skyrl_train_count, exclude=[skyrl_eval])
    local_train = training_mazes(spec.local_sizes, spec.local_train_count, exclude=[local_eval, heldout])

    sets = {
        "skyrl_train": (paths.skyrl_train, [skyrl_row(m, skyrl_eval.data_source, "train") for m in skyrl_train]),
        "skyrl_eval": (paths.skyrl_eval, [skyrl_row(m, skyrl_eval.data_source, "test") for m in skyrl_eval.mazes()]),
        "local_train": (paths.local_train, [local_row(m, f"maze_2d/local{m.size}") for m in local_train]),
        "local_eval": (paths.local_eval, [local_row(m, local_eval.data_source) for m in local_eval.mazes()]),
        "local_heldout": (paths.local_heldout, [local_row(m, heldout.data_source) for m in heldout.mazes()]),
    }
    for path, rows in sets.values():
        write_parquet(rows, path)
    manifest = {
        "files": {name: {"path": str(path.relative_to(paths.root)), "rows": len(rows)}
                  for name, (path, rows) in sets.items()},
        "eval_sets": {s.data_source: {"size": s.size, "seeds": [s.seeds[0], s.seeds[-1]],
                                      "layout_sha256": layout_digest(s.mazes())}
                      for s in (skyrl_eval, local_eval, heldout)},
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: dataset missing; run `rlops data build` first")
    return pq.read_table(path).to_pylist()
