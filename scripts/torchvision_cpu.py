"""Lets PyPI's torchvision (a CUDA build) import beside CPU torch; installed by scripts/install.sh with a .pth.

Its C++ ops cannot load, so `torchvision/_meta_registrations.py` fails on `register_fake("torchvision::nms")`
and `::qnms` for want of their schemas. Declaring the two schemas just before torchvision imports is enough
for its Python transforms (what transformers' Qwen2/3-VL processors use); the ops themselves stay unusable.
"""
import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if torch.version.cuda is not None:  # a CUDA torch loads torchvision's real ops
            return None
        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            try:
                library.define(schema)
            except RuntimeError:  # already declared (a CPU build of torchvision loaded its own ops)
                pass
        _KEEP.append(library)
        return None


_KEEP: list = []  # a torch.library.Library drops its definitions when collected
sys.meta_path.insert(0, _DeclareOpsFirst())
