"""The maze task (VisGym's maze_2d rebuilt offline): generator, renderer, solver, datasets, SkyRL env."""
from tasks.maze.task import MazeTask

__all__ = ["MazeTask"]
