"""Dumped SkyRL eval trajectories of the maze, replayed as the env stepped them (no skyrl-gym needed)."""
from __future__ import annotations

import functools
from typing import Any, Mapping

from tasks.maze.env import DIRECTION_WORDS, STOP, MazeEpisode, generate_maze, parse_action, render

# Qwen's chat format (the recipe's Qwen3-VL, the tiny test VLM): a multi-turn response SkyRL decodes holds
# each assistant turn, its end token, the env's observation, then the next turn's assistant header.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


def assistant_turns(response: str) -> list[str]:
    """The assistant's text of each turn of a decoded multi-turn response (observations left out)."""
    return [piece.split(TURN_END, 1)[0].strip() for piece in response.split(ASSISTANT_HEADER)]


def eval_sample_columns(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The maze's columns of a sample-table row of one dumped SkyRL eval trajectory: the policy's turns
    replayed as the env stepped them, as moves (`?` for an answer that is no action) and the maze with
    the agent where they left it (rendered later, on the sample thread)."""
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
