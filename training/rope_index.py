"""Qwen3-VL's M-RoPE positions for a batch in a few tensor ops. HF's `get_rope_index` walks every row in Python
(groupby over its token types, one arange per group), twice per GRPO step over 32 rows; this computes the same
positions and deltas for text and images, and hands anything else (videos, an image group that does not
match its grid) to HF's own."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMAGE = 1  # mm_token_type_ids: 0 text, 1 image, 2 video


class RopeIndex:
    """Replaces a Qwen3-VL model's `get_rope_index` (`install`); `fallbacks` counts the calls HF answered."""

    def __init__(self, model: torch.nn.Module):
        self.stock = model.get_rope_index
        self.merge = model.config.vision_config.spatial_merge_size
        self.calls = self.fallbacks = 0

    @classmethod
    def install(cls, model: torch.nn.Module) -> "RopeIndex":
        """`model` is the HF Qwen3-VL for conditional generation; returns the installed index."""
        index = cls(model.model)
        model.model.get_rope_index = index
        return index

    def __call__(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                 image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs):
        answer = None
        if video_grid_thw is None and image_grid_thw is not None and not kwargs:
            answer = self._positions(input_ids, mm_token_type_ids, image_grid_thw, attention_mask)
        if answer is None:
            self.fallbacks += 1
            return self.stock(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw,
                              video_grid_thw=video_grid_thw, attention_mask=attention_mask, **kwargs)
        self.calls += 1
        return answer

    def _positions(self, input_ids, types, grids, attention_mask) -> tuple[torch.Tensor, torch.Tensor] | None:
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        image = (types == IMAGE) & valid
        text = (types == 0) & valid
        if bool(((types != 0) & (types != IMAGE) & valid).any()):
            return None
        # an image group starts at an image token whose previous *valid* token is not one (HF groups the valid
        # tokens of a row by type, so padding does not split a group)
        index = valid.long().cumsum(1) - 1  # each token's place among its row's valid tokens
        columns = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        last_valid = torch.where(valid, columns, -1).cummax(1).values
        before = F.pad(last_valid[:, :-1], (1, 0), value=-1)
        starts = image & ~(image.gather(1, before.clamp(min=0)) & (before >= 0))
        if len(grids) == 0 or int(starts.sum()) != len(grids):
            return None
        t, h, w = grids[:, 0], grids[:, 1] // self.merge, grids[:, 2] // self.merge
        ordinal = (starts.flatten().long().cumsum(0) - 1).view_as(starts)  # each image token's image, batch order
        if not torch.equal(torch.bincount(ordinal[image], minlength=len(grids)), t * h * w):
            return None
        at = ordinal.clamp(min=0)  # per token: its image's grid and span (text tokens: any, masked below)
        h_at, w_at = h[at], w[at]
        span_at = torch.maximum(h_at, w_at)  # positions an image moves the text after it by
        texts_before = text.long().cumsum(1) - text.long()
        spans_so_far = (span_at * starts).cumsum(1)
        k = index - (index * starts).cummax(1).values  # place within its image
        here = texts_before + spans_so_far - span_at * image
        offsets = torch.stack([k // (h_at * w_at), (k // w_at) % h_at, k % w_at]) * image
        positions = (here.unsqueeze(0) + offsets) * valid
        deltas = (positions.amax(dim=(0, 2)) + 1 - valid.sum(1)).unsqueeze(1)
        return positions.to(input_ids.dtype), deltas
