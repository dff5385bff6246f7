"""The batched M-RoPE index gives HF's `get_rope_index` positions and deltas exactly, on generated batches of
text and images with left and right padding, and hands what it does not implement (videos) to HF."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForImageTextToText

from training.rope_index import IMAGE, RopeIndex
from training.tiny_vlm import build_tiny_vlm


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = build_tiny_vlm(tmp_path_factory.mktemp("tiny") / "base", seed=0)
    return AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32)


# a row: text groups (0: one masked token inside the row) and images, an image as its (h, w) grid in patches
# (merge 2: even sides). Two images are apart (vision_end, vision_start) as the template writes them, unless only
# a masked token is between them: HF then reads them as one group, and so must the index (it hands them to HF).
rows = st.lists(st.one_of(st.integers(0, 5), st.tuples(st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 6]))),
                min_size=1, max_size=5)


def batch(layouts: list[list], pads: list[tuple[int, int]]) -> dict:
    types, holes, grids = [], [], []
    for layout in layouts:
        row, hole, last = [], [], None
        for group in layout:
            if group == 0:
                hole.append(len(row))
                row.append(0)
            elif isinstance(group, int):
                row += [0] * group
            else:
                if last == IMAGE:
                    row.append(0)
                row += [IMAGE] * (group[0] * group[1] // 4)
                grids.append([1, *group])
            last = IMAGE if not isinstance(group, int) else 0
        types.append(row)
        holes.append(hole)
    width = max(len(r) + left + right for r, (left, right) in zip(types, pads))
    token_types, mask = [], []
    for row, hole, (left, right) in zip(types, holes, pads):
        right = width - len(row) - left
        token_types.append([0] * left + row + [0] * right)
        mask.append([0] * left + [0 if i in hole else 1 for i in range(len(row))] + [0] * right)
    token_types = torch.tensor(token_types)
    return {"input_ids": torch.randint(10, 60, token_types.shape), "mm_token_type_ids": token_types,
            "image_grid_thw": torch.tensor(grids).reshape(-1, 3), "attention_mask": torch.tensor(mask)}


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(rows, st.tuples(st.integers(0, 3), st.integers(0, 3))), min_size=1, max_size=4),
       masked=st.booleans())
def test_positions_and_deltas_are_hfs(model, data, masked):
    layouts, pads = [d[0] for d in data], [d[1] for d in data]
    inputs = batch(layouts, pads if masked else [(0, 0)] * len(layouts))
    assume(len(inputs["image_grid_thw"]) > 0 and bool(inputs["attention_mask"].any(1).all()))
    if not masked:  # no mask at all: rows of one length only
        assume(bool(inputs["attention_mask"].all()))
        inputs["attention_mask"] = None
    apart = all(not (isinstance(a, tuple) and b == 0 and isinstance(c, tuple))
                for layout in layouts for a, b, c in zip(layout, layout[1:], layout[2:]))
    index = RopeIndex(model.model)
    try:
        hf_positions, hf_deltas = model.model.get_rope_index(**inputs)
    except RuntimeError as hf_refused:  # HF cannot place the tokens of two images read as one group
        assert not apart
        with pytest.raises(type(hf_refused)):
            index(**inputs)
        assert (index.calls, index.fallbacks) == (0, 1)
        return
    positions, deltas = index(**inputs)
    assert (index.calls, index.fallbacks) == ((1, 0) if apart else (0, 1))
    assert torch.equal(positions, hf_positions) and positions.dtype == hf_positions.dtype
    assert torch.equal(deltas, hf_deltas)


def test_videos_go_to_hf(model):
    inputs = batch([[3, (2, 2), 2]], [(1, 0)])
    inputs["mm_token_type_ids"] = torch.where(inputs["mm_token_type_ids"] == IMAGE, 2, 0)
    inputs["video_grid_thw"], grids = inputs.pop("image_grid_thw"), None
    index = RopeIndex(model.model)
    positions, deltas = index(**inputs, image_grid_thw=grids)
    hf_positions, hf_deltas = model.model.get_rope_index(**inputs, image_grid_thw=grids)
    assert (index.calls, index.fallbacks) == (0, 1)
    assert torch.equal(positions, hf_positions) and torch.equal(deltas, hf_deltas)
