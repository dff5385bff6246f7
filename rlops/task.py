"""The task contract: what a verifiable visual task gives the trainer, the tracker and promotion.

A task is a class named by import path in `mlflow.yaml` (`task.path: "package.module:Class"`, its own
settings under `task.options`, validated by the class's `Options` model). It names its eval sets (by data
source), hands out items (an id, one image and the user's text, plus the `target` its scorer needs), and
scores a completion as an `Outcome` (id, passed, score, extras): one row of the eval table. Nothing above
this module imports a task: `load_task` imports it by name, so the packages that only score or compare
(tracker, registry_hooks, serving) never depend on one.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import inspect
import io
import json
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

DEFAULT_TASK = "tasks.maze:MazeTask"
# where the default task's runs and versions go unless mlflow.yaml says otherwise
DEFAULT_EXPERIMENT, DEFAULT_MODEL = "visgym-maze-grpo", "maze-grpo"
TAG_TASK = "rlops.task"  # on a run: the import path of the task it trained on (what `promote verify` loads)
TASK_PARAM_PREFIX = "task."  # + option name: a run's params holding the task's options


class TaskError(ValueError):
    """A task that cannot be loaded or an item it does not know, with a message naming the key."""


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task. `image()` renders it (an RGB uint8 array, lazily: sets are built by the
    thousand); `target` is what the scorer needs, JSON-safe, so an item survives a dataset round trip."""

    id: str
    text: str
    image: Callable[[], Any]
    target: Any = None

    def messages(self) -> list[dict]:
        """The item as an OpenAI chat request's messages (the image inline as a PNG data URL)."""
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(self.image())}},
                                             {"type": "text", "text": self.text}]}]


@dataclass(frozen=True)
class Outcome:
    """A scored completion: one eval-table row (rlops.eval_table)."""

    id: str
    passed: bool
    score: float
    extras: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {"id": self.id, "passed": self.passed, "score": self.score, "extras": dict(self.extras)}


class Task(ABC):
    """Subclass, implement the abstract methods, point `task.path` at the class.

    `name` prefixes the task's data sources and names its runs' training set; `answer_length` bounds a
    completion (the trainer's and the served eval's max_tokens; a task may set it from its options). A task with a SkyRL multi-turn env names
    its entry point and id; `skyrl_sample_columns` renders a dumped SkyRL eval trajectory for the samples."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    answer_length: ClassVar[int] = 20
    skyrl_env_id: ClassVar[str | None] = None
    skyrl_env_entry_point: ClassVar[str | None] = None

    def __init__(self, options: BaseModel):
        self.options = options

    @abstractmethod
    def eval_sets(self) -> list[str]:
        """Data sources of the task's eval sets; the first is the fixed set the local trainer selects on."""

    @abstractmethod
    def eval_items(self, data_source: str) -> list[TaskItem]:
        """The items of one eval set, in a fixed order; raise TaskError for a data source not of this task."""

    @abstractmethod
    def train_items(self, count: int) -> list[TaskItem]:
        """`count` training prompts (ids unique among them), none of which is in an eval set."""

    @abstractmethod
    def score(self, item: TaskItem, completion: str) -> Outcome:
        """The task's verdict on a completion; reads only the item's id and target."""

    @abstractmethod
    def demonstration(self, item: TaskItem, rng: random.Random) -> str:
        """An answer to imitate in the supervised warm start of the tiny base."""

    def demonstration_items(self, count: int) -> list[TaskItem]:
        """The warm start's items (never an eval item); the training items unless the task has others."""
        return self.train_items(count)

    def reward(self, item: TaskItem, completion: str) -> float:
        """GRPO's training reward; the eval's score unless the task shapes it."""
        return self.score(item, completion).score

    def sample_columns(self, item: TaskItem, completion: str) -> dict[str, Any]:
        """Extra columns of a sample-table row (how the task read the completion)."""
        return {}

    def skyrl_sample_columns(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def request_item(self, image: Any, text: str) -> TaskItem | None:
        """The item a served request is, read from the request itself (its image, an RGB uint8 array, and
        the user's text), so production traffic can be scored; None where the task cannot tell (the
        default: such requests are traced unscored)."""
        return None

    def illustrate(self, item: TaskItem, completion: str) -> Any:
        """The item's image with what `completion` did drawn on it (the maze draws the walk), an RGB uint8
        array: the demo's lift picture shows it. The item's own image unless the task can draw more."""
        return item.image()

    def items_digest(self, items: list[TaskItem]) -> str:
        """sha256 of the items' ids and targets, in order: pins an eval or training set wherever it is built."""
        digest = hashlib.sha256()
        for item in items:
            digest.update(json.dumps([item.id, item.target], sort_keys=True, separators=(",", ":")).encode())
            digest.update(b"\n")
        return digest.hexdigest()


def task_path(name: str) -> str:
    """An import path, or a shipped task's name: `shapes` -> `tasks.shapes:ShapesTask`, `maze` -> `tasks.maze:MazeTask`."""
    if ":" in name:
        return name
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise TaskError(f"task {name!r}: give a shipped task's name (e.g. maze, shapes) or 'package.module:ClassName'")
    return f"tasks.{name}:{''.join(part.title() for part in name.split('_'))}Task"


def load_task(path: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task class at `path` ("module:Class"), built with its validated `options`; TaskError naming
    `task.path` or `task.options` and what is wrong."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise TaskError(f"task.path {path!r} must be 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task.path {path!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise TaskError(f"task.path {path!r}: {module_name} has no Task subclass {class_name!r} "
                        f"(found {type(cls).__name__ if cls is not None else 'nothing'})")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TaskError(f"task.path {path!r}: {class_name} does not implement {', '.join(missing)}")
    if not isinstance(getattr(cls, "name", None), str):
        raise TaskError(f"task.path {path!r}: {class_name} has no `name` (a string naming its data sources)")
    try:
        return cls(cls.Options.model_validate(dict(options or {})))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise TaskError(f"task.options for {path}: {problems}") from None


def image_data_url(image) -> str:
    """An RGB array as an OpenAI `image_url` data URL (PNG)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
