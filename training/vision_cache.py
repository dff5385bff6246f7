"""The frozen vision tower encodes each distinct image once. GRPO repeats every prompt `num_generations`
times, scores the batch again for the loss, and draws the same mazes again in later steps; LoRA trains
the language model only, so the tower's output for an image cannot change during a run."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

MAX_IMAGES = 4096  # ~14 KB each for the tiny base's 96 px mazes


class VisionCache:
    """Wraps a Qwen3-VL vision tower's `forward` (patches of several images concatenated, one grid row
    per image): images seen before come from the cache, the others are encoded together in one call."""

    def __init__(self, visual: torch.nn.Module, max_images: int = MAX_IMAGES):
        self.visual, self.encode, self.max_images = visual, visual.forward, max_images
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()
        self.output_type = None  # the tower's output class, taken from its first call
        self.hits = self.misses = 0

    @classmethod
    def install(cls, model: torch.nn.Module) -> "VisionCache":
        """Freeze `model`'s vision tower and serve its forward through a cache; returns the cache."""
        visual = model.model.visual
        visual.requires_grad_(False)
        cache = cls(visual)
        visual.forward = cache.forward
        return cache

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        patches = grid_thw.prod(-1).tolist()
        merge = self.visual.spatial_merge_size ** 2
        images = torch.split(hidden_states, patches)
        keys = [(hashlib.blake2b(image.detach().contiguous().cpu().numpy().tobytes(), digest_size=16).digest(),
                 tuple(row)) for image, row in zip(images, grid_thw.tolist())]
        missing, queued = [], set()
        for i, key in enumerate(keys):
            if key not in self.entries and key not in queued:
                queued.add(key)
                missing.append(i)
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        if missing:
            with torch.no_grad():
                out = self.encode(torch.cat([images[i] for i in missing]), grid_thw[missing], **kwargs)
            self.output_type = type(out)
            sizes = [patches[i] for i in missing]
            merged = [size // merge for size in sizes]
            split = zip(torch.split(out.last_hidden_state, sizes), torch.split(out.pooler_output, merged),
                        zip(*(torch.split(f, merged) for f in out.deepstack_features)))
            for i, (last, pooled, deep) in zip(missing, split):
                self.entries[keys[i]] = (last, pooled, deep)
        found = []
        for key in keys:
            self.entries.move_to_end(key)
            found.append(self.entries[key])
        while len(self.entries) > self.max_images:
            self.entries.popitem(last=False)
        return self.output_type(
            last_hidden_state=torch.cat([f[0] for f in found]), pooler_output=torch.cat([f[1] for f in found]),
            deepstack_features=[torch.cat([f[2][d] for f in found]) for d in range(len(found[0][2]))])
