"""The maze task, following VisGym's `maze_2d` contract (pure logic: no I/O, no model).

A maze is a square grid of odd size with a one-cell outer wall; the interior is a spanning tree of the
odd-coordinate cells drawn with Wilson's loop-erased random walk, so every pair of cells has exactly one
path. Agent and target sit in opposite interior corners (which pair, and who sits where, is random).
`generate_maze(seed, size)` is deterministic everywhere: it seeds Python's `random.Random` with a string,
which is hashed with SHA-512 (stable across platforms and Python versions).

Coordinates are (row, col); directions follow VisGym: 0 right, 1 up, 2 left, 3 down.
"""
from __future__ import annotations

import ast
import random
import re
import warnings
from collections import deque
from dataclasses import dataclass

import numpy as np

LEVEL_SIZES = {"easy": 9, "hard": 11}
CELL_PX = 25
WALL_RGB = (169, 169, 169)
PATH_RGB = (255, 255, 255)
AGENT_RGB = (0, 0, 255)
TARGET_RGB = (255, 0, 0)
WALK_RGB = (120, 170, 255)
_CELL_COLOURS = np.array([PATH_RGB, WALL_RGB], np.uint8)  # indexed by "is a wall"
_AGENT_DISC = np.add.outer((np.arange(CELL_PX) - (CELL_PX - 1) / 2) ** 2,
                           (np.arange(CELL_PX) - (CELL_PX - 1) / 2) ** 2) <= (CELL_PX * 0.38) ** 2

DIRECTION_DELTAS = {0: (0, 1), 1: (-1, 0), 2: (0, -1), 3: (1, 0)}
DIRECTION_WORDS = ("right", "up", "left", "down")
STOP = ("stop", "stop")

FEEDBACK_OK = "Action executed successfully."
FEEDBACK_WALL = "Cannot move into a wall."
FEEDBACK_DONE = "The episode has ended."

Position = tuple[int, int]
Action = tuple[str, object]  # ("move", 0..3) or ("stop", "stop")


@dataclass(frozen=True)
class Maze:
    seed: int
    size: int
    rows: tuple[str, ...]  # '#' wall, '.' path
    start: Position
    goal: Position

    def is_wall(self, pos: Position) -> bool:
        r, c = pos
        return not (0 <= r < self.size and 0 <= c < self.size) or self.rows[r][c] == "#"

    def ansi(self, agent: Position | None = None) -> str:
        """VisGym's text mode: `#` wall, `A` agent, `T` target."""
        agent = self.start if agent is None else agent
        lines = []
        for r, row in enumerate(self.rows):
            chars = ["#" if ch == "#" else " " for ch in row]
            if self.goal[0] == r:
                chars[self.goal[1]] = "T"
            if agent[0] == r:
                chars[agent[1]] = "A"
            lines.append("".join(chars))
        return "\n".join(lines)

    def layout(self) -> dict:
        """What identifies the maze (seed, grid, start, goal): hashed to pin eval sets, stored in datasets."""
        return {"seed": self.seed, "size": self.size, "rows": list(self.rows),
                "start": list(self.start), "goal": list(self.goal)}


def level_size(level: str) -> int:
    if level not in LEVEL_SIZES:
        raise ValueError(f"unknown maze level {level!r}; expected one of {sorted(LEVEL_SIZES)}")
    return LEVEL_SIZES[level]


def generate_maze(seed: int, size: int) -> Maze:
    """The maze of `seed` at `size` (odd, >= 5, outer wall included), by Wilson's algorithm."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"maze seed must be a non-negative integer, got {seed!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be an odd integer >= 5 (outer wall included), got {size!r}")
    rng = random.Random(f"maze_2d:{size}:{seed}")
    cells = [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]
    grid = [["#"] * size for _ in range(size)]
    in_tree = {cells[rng.randrange(len(cells))]}
    grid[next(iter(in_tree))[0]][next(iter(in_tree))[1]] = "."
    for cell in cells:
        if cell in in_tree:
            continue
        # Loop-erased random walk from `cell` until it hits the tree; `exit_dir` keeps only the last exit.
        exit_dir: dict[Position, Position] = {}
        here = cell
        while here not in in_tree:
            options = [(dr, dc) for dr, dc in ((0, 2), (-2, 0), (0, -2), (2, 0))
                       if 1 <= here[0] + dr < size - 1 and 1 <= here[1] + dc < size - 1]
            step = options[rng.randrange(len(options))]
            exit_dir[here] = step
            here = (here[0] + step[0], here[1] + step[1])
        here = cell
        while here not in in_tree:
            dr, dc = exit_dir[here]
            grid[here[0]][here[1]] = "."
            grid[here[0] + dr // 2][here[1] + dc // 2] = "."
            in_tree.add(here)
            here = (here[0] + dr, here[1] + dc)
    low, high = 1, size - 2
    corners = [((low, low), (high, high)), ((low, high), (high, low))][rng.randrange(2)]
    start, goal = corners if rng.randrange(2) == 0 else corners[::-1]
    return Maze(seed=seed, size=size, rows=tuple("".join(row) for row in grid), start=start, goal=goal)


def render(maze: Maze, agent: Position | None = None) -> np.ndarray:
    """RGB uint8 image, CELL_PX per cell: gray walls, white paths, red target square, blue agent circle."""
    agent = maze.start if agent is None else agent
    walls = np.frombuffer("".join(maze.rows).encode(), np.uint8).reshape(maze.size, maze.size) == ord("#")
    # colour the cells, then scale them up: the trainers draw a maze per prompt and per SFT example
    image = _CELL_COLOURS[walls.view(np.uint8)].repeat(CELL_PX, 0).repeat(CELL_PX, 1)
    inset = CELL_PX // 5
    gr, gc = maze.goal
    image[gr * CELL_PX + inset:(gr + 1) * CELL_PX - inset, gc * CELL_PX + inset:(gc + 1) * CELL_PX - inset] = TARGET_RGB
    ar, ac = agent
    image[ar * CELL_PX:(ar + 1) * CELL_PX, ac * CELL_PX:(ac + 1) * CELL_PX][_AGENT_DISC] = AGENT_RGB
    return image


def read_image(image: np.ndarray) -> Maze | None:
    """The maze `render` drew (walls, start, goal), read back from its pixels; None for any other image (a
    resized or lossy copy, another picture). Seed -1: the layout came from an image, not a generator."""
    if image.ndim != 3 or image.shape[2] < 3 or image.shape[0] != image.shape[1] or image.shape[0] % CELL_PX:
        return None
    size = image.shape[0] // CELL_PX
    cells = image[:, :, :3].reshape(size, CELL_PX, size, CELL_PX, 3)
    corner = cells[:, 0, :, 0]  # a cell's corner is never under the target square or the agent disc
    centre = cells[:, CELL_PX // 2, :, CELL_PX // 2]
    walls, paths = (corner == WALL_RGB).all(-1), (corner == PATH_RGB).all(-1)
    goals, agents = np.argwhere((centre == TARGET_RGB).all(-1)), np.argwhere((centre == AGENT_RGB).all(-1))
    if size < 3 or not (walls | paths).all() or len(goals) != 1 or len(agents) != 1:
        return None
    rows = tuple("".join("#" if wall else "." for wall in row) for row in walls)
    start, goal = (int(agents[0][0]), int(agents[0][1])), (int(goals[0][0]), int(goals[0][1]))
    if rows[start[0]][start[1]] == "#" or rows[goal[0]][goal[1]] == "#":
        return None
    return Maze(seed=-1, size=size, rows=rows, start=start, goal=goal)


def render_walk(maze: Maze, cells: tuple[Position, ...]) -> np.ndarray:
    """The maze with the cells a walk went through tinted, the agent where it ended."""
    image = render(maze, agent=cells[-1] if cells else None)
    inset = CELL_PX // 3
    for r, c in cells[:-1]:
        image[r * CELL_PX + inset:(r + 1) * CELL_PX - inset, c * CELL_PX + inset:(c + 1) * CELL_PX - inset] = WALK_RGB
    return image


def move(maze: Maze, pos: Position, direction: int) -> Position | None:
    """The cell one step away, or None when it is a wall."""
    dr, dc = DIRECTION_DELTAS[direction]
    target = (pos[0] + dr, pos[1] + dc)
    return None if maze.is_wall(target) else target


def distances_to_goal(maze: Maze) -> dict[Position, int]:
    """BFS distance (in moves) from every reachable cell to the goal."""
    dist = {maze.goal: 0}
    queue = deque([maze.goal])
    while queue:
        here = queue.popleft()
        for direction in DIRECTION_DELTAS:
            nxt = move(maze, here, direction)
            if nxt is not None and nxt not in dist:
                dist[nxt] = dist[here] + 1
                queue.append(nxt)
    return dist


def solve(maze: Maze, start: Position | None = None) -> list[int]:
    """A shortest sequence of directions from `start` (default: the maze's start) to the goal (BFS)."""
    dist = distances_to_goal(maze)
    here = maze.start if start is None else start
    if here not in dist:
        raise ValueError(f"no path from {here} to the goal")
    path = []
    while here != maze.goal:
        direction = next(d for d in DIRECTION_DELTAS
                         if (n := move(maze, here, d)) is not None and dist.get(n) == dist[here] - 1)
        path.append(direction)
        here = move(maze, here, direction)
    return path


def demonstration(maze: Maze) -> list[Action]:
    """VisGym's optimal demonstration: the BFS moves, then the stop action twice."""
    return [("move", d) for d in solve(maze)] + [STOP, STOP]


# ------------------------------------------------------------------------------------------- parsing

_WORD_ACTIONS: dict[str, Action] = {**{w: ("move", d) for d, w in enumerate(DIRECTION_WORDS)}, "stop": STOP}
_TUPLE = re.compile(r"\(\s*['\"]?(move|stop)['\"]?\s*,\s*['\"]?([0-3]|stop)['\"]?\s*\)", re.I)


def parse_action(text: object) -> Action | None:
    """One action from model output, or None (never raises).

    Accepted: VisGym's tuple strings `('move', d)` / `('stop', 'stop')` (the last one in the text wins,
    so a model may think before acting), and SkyRL's plain words right/up/left/down/stop.
    """
    if not isinstance(text, str):
        return None
    stripped = text.strip()
    try:
        with warnings.catch_warnings():  # model output such as "1st" warns as an invalid literal
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(stripped) if len(stripped) < 64 else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = None
    if isinstance(value, tuple) and len(value) == 2:
        if value[0] == "move" and type(value[1]) is int and value[1] in DIRECTION_DELTAS:
            return ("move", value[1])
        if value == STOP:
            return STOP
    matches = _TUPLE.findall(stripped)
    if matches:
        verb, arg = matches[-1][0].lower(), matches[-1][1].lower()
        if verb == "move" and arg.isdigit():
            return ("move", int(arg))
        if verb == "stop" and arg == "stop":
            return STOP
        return None
    return _WORD_ACTIONS.get(stripped.lower().strip(" .!'\"`"))


def parse_failure(text: object) -> str:
    shown = repr(text)[:80] if isinstance(text, str) else type(text).__name__
    return (f"Cannot parse action string {shown}. Use ('move', d) with d = 0 right, 1 up, 2 left, 3 down, "
            f"or ('stop', 'stop').")


# ------------------------------------------------------------------------------------------- episode


@dataclass
class StepResult:
    reward: float
    done: bool
    feedback: str
    valid: bool


class MazeEpisode:
    """One multi-turn episode: reward 1.0 only for stopping on the target; a stop ends the episode.

    Reaching the target does not end it, and the episode never truncates itself: the harness caps turns.
    """

    def __init__(self, maze: Maze):
        self.maze = maze
        self.agent = maze.start
        self.done = False
        self.solved = False
        self.steps = 0
        self.invalid_actions = 0
        self.wall_bumps = 0

    def step(self, text: object) -> StepResult:
        if self.done:
            return StepResult(0.0, True, FEEDBACK_DONE, valid=False)
        self.steps += 1
        action = parse_action(text)
        if action is None:
            self.invalid_actions += 1
            return StepResult(0.0, False, parse_failure(text), valid=False)
        if action == STOP:
            self.done = True
            self.solved = self.agent == self.maze.goal
            return StepResult(1.0 if self.solved else 0.0, True, FEEDBACK_OK, valid=True)
        nxt = move(self.maze, self.agent, int(action[1]))
        if nxt is None:
            self.wall_bumps += 1
            return StepResult(0.0, False, FEEDBACK_WALL, valid=False)
        self.agent = nxt
        return StepResult(0.0, False, FEEDBACK_OK, valid=True)

    def image(self) -> np.ndarray:
        return render(self.maze, self.agent)

    def distance_to_goal(self) -> int:
        return distances_to_goal(self.maze)[self.agent]


# ------------------------------------------------------------------------- single-turn (local trainer)


@dataclass(frozen=True)
class WalkResult:
    """Outcome of a whole answer (`right right down stop`) walked from the start."""

    solved: bool          # the unshaped task reward: the walk stopped on the target
    stopped: bool         # the answer ended with a stop (no trailing junk)
    steps: int            # moves taken (valid ones)
    final_distance: int   # BFS moves from where the walk ended to the target
    start_distance: int
    bumped: bool          # a move into a wall ended the walk
    malformed: bool       # a word that is not an action ended the walk
    moves_past_goal: int  # moves made after standing on the target
    cells: tuple[Position, ...] = ()  # where the walk went, the start first


def walk_answer(maze: Maze, answer: str) -> WalkResult:
    """Walk a move-sequence answer (the generation length caps it). A wall bump or a non-action word
    ends the walk as a failure: if a bump left the agent in place, a policy blind to the image would
    solve most small mazes by trying every direction."""
    dist = distances_to_goal(maze)
    here, steps, past_goal = maze.start, 0, 0
    cells = [here]
    stopped = bumped = malformed = False
    for word in _answer_words(answer):
        action = _WORD_ACTIONS.get(word)
        if action is None:
            malformed = True
            break
        if action == STOP:
            stopped = True
            break
        nxt = move(maze, here, int(action[1]))
        if nxt is None:
            bumped = True
            break
        if here == maze.goal:
            past_goal += 1
        here, steps = nxt, steps + 1
        cells.append(here)
    return WalkResult(solved=stopped and here == maze.goal, stopped=stopped, steps=steps,
                      final_distance=dist[here], start_distance=dist[maze.start], bumped=bumped,
                      malformed=malformed, moves_past_goal=past_goal, cells=tuple(cells))


def random_walk(maze: Maze, rng: random.Random) -> list[int]:
    """A walk that reads the walls but not the way: from the start, never into a wall and never straight
    back, each branch picked uniformly at random, until the target or a dead end (where it stops). An SFT
    target that teaches perception (corridors, dead ends, where the target is) and leaves the decision at
    each junction to be learnt from the task reward."""
    here, previous, directions = maze.start, None, []
    while here != maze.goal:
        options = [d for d in DIRECTION_DELTAS if (n := move(maze, here, d)) is not None and n != previous]
        if not options:
            break
        direction = options[rng.randrange(len(options))]
        previous, here = here, move(maze, here, direction)
        directions.append(direction)
    return directions


def _answer_words(answer: str) -> list[str]:
    return [word.strip(".!'\"`") for word in answer.lower().replace(",", " ").split()]


def answer_moves(answer: str) -> list[str]:
    """The action words of an answer as `walk_answer` reads them, up to `stop` or the first non-action."""
    moves = []
    for word in _answer_words(answer):
        if word not in _WORD_ACTIONS:
            break
        moves.append(word)
        if word == "stop":
            break
    return moves


def answer_text(directions: list[int]) -> str:
    """The single-turn answer for a move list: direction words, then `stop`."""
    return " ".join([DIRECTION_WORDS[d] for d in directions] + ["stop"])
