"""The maze as a SkyRL-gym multi-turn env, registered as `visgym` (the id SkyRL's VisGym recipe
uses) from `MazeTask.skyrl_env_id`.

Each turn the model answers one action; the env replies with the new image and VisGym's feedback text
as the next user message. Reward comes only at the end: 1.0 for stopping on the target.
"""
from __future__ import annotations

import json
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from rlops.task import image_data_url
from tasks.maze.env import MazeEpisode, generate_maze


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
