"""The maze as a SkyRL-gym multi-turn env, registered as `visgym` (the id SkyRL's VisGym recipe uses).

Each turn the model answers one action; the env replies with the new image and VisGym's feedback text
as the next user message. Reward comes only at the end: 1.0 for stopping on the target.
"""
from __future__ import annotations

import base64
import functools
import io
import json
from typing import Any, Mapping

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from training.datasets import ENV_CLASS
from training.maze import DIRECTION_WORDS, STOP, MazeEpisode, generate_maze, parse_action, render

ENTRY_POINT = "training.skyrl_env:VisGymMazeEnv"
# Qwen's chat format (the recipe's Qwen3-VL, the tiny test VLM): a multi-turn response SkyRL decodes holds
# each assistant turn, its end token, the env's observation, then the next turn's assistant header.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


def image_data_url(image) -> str:
    """An RGB array as an OpenAI `image_url` data URL (PNG)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(image, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(image)}},
                                        {"type": "text", "text": text}]}


class VisGymMazeEnv(BaseTextEnv):
    """`extras` is the dataset row minus prompt/env_class: `extra_info` carries seed, size and layout."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        info = extras.get("extra_info") or {}
        try:
            seed, size = int(info["seed"]), int(info["size"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"visgym env needs extra_info with integer 'seed' and 'size', got {info!r}") from None
        maze = generate_maze(seed, size)
        if info.get("layout") and json.loads(info["layout"]) != json.loads(json.dumps(maze.layout())):
            raise ValueError(f"maze seed {seed} size {size}: dataset layout differs from the generator's")
        self.episode = MazeEpisode(maze)
        self.max_turns = int(extras.get("max_turns") or info.get("max_turns") or 15)

    def init(self, prompt: list[dict]) -> tuple[list[dict], dict]:
        """Attach the first image to the last user message of the prompt."""
        conversation = [dict(m) for m in prompt]
        last_user = max(i for i, m in enumerate(conversation) if m["role"] == "user")
        text = conversation[last_user]["content"]
        conversation[last_user] = image_message(self.episode.image(), text if isinstance(text, str) else "")
        return conversation, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        result = self.episode.step(action)
        done = result.done or self.turns >= self.max_turns
        observations = [] if done else [image_message(self.episode.image(), result.feedback)]
        return BaseTextEnvStepOutput(observations=observations, reward=result.reward, done=done,
                                     metadata={"feedback": result.feedback, "valid": result.valid})

    def get_metrics(self) -> dict[str, Any]:
        return {"solved": float(self.episode.solved), "steps": self.episode.steps,
                "invalid_actions": self.episode.invalid_actions, "wall_bumps": self.episode.wall_bumps,
                "final_distance": self.episode.distance_to_goal()}


def register_visgym_env() -> None:
    """Register the env with skyrl-gym as `visgym` (idempotent)."""
    from skyrl_gym.envs import register
    from skyrl_gym.envs.registration import registry

    if ENV_CLASS not in registry:
        register(id=ENV_CLASS, entry_point=ENTRY_POINT)


def assistant_turns(response: str) -> list[str]:
    """The assistant's text of each turn of a decoded multi-turn response (observations left out)."""
    return [piece.split(TURN_END, 1)[0].strip() for piece in response.split(ASSISTANT_HEADER)]


def eval_sample_columns(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The maze's columns of a sample-table row of one dumped SkyRL eval trajectory (the tracker's
    `task_columns`): the policy's turns replayed as the env stepped them, as moves (`?` for an answer that
    is no action) and the maze with the agent where they left it (rendered later, on the sample thread)."""
    info = (entry.get("env_extras") or {}).get("extra_info") or {}
    maze = generate_maze(int(info["seed"]), int(info["size"]))
    episode, moves = MazeEpisode(maze), []
    for turn in assistant_turns(str(entry.get("output_response") or "")):
        if episode.done:
            break
        action = parse_action(turn)
        moves.append("?" if action is None else "stop" if action == STOP else DIRECTION_WORDS[action[1]])
        episode.step(turn)
    return {"image": functools.partial(render, maze, episode.agent), "moves": " ".join(moves)}
