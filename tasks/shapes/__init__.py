"""Counting shapes: how many red squares does the picture hold? A second task, different in kind from the maze."""
from tasks.shapes.task import ShapesTask

__all__ = ["ShapesTask"]
