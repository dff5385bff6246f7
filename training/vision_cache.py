"""Each distinct prompt row is processed once, each distinct image preprocessed once and encoded by the frozen
vision tower once. GRPO repeats every prompt `num_generations` times, processes the batch again for the loss,
and draws the same mazes again in later steps; LoRA trains the language model only, so the tower's output for
an image cannot change during a run."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from PIL import Image
from transformers import BatchFeature, TrainerCallback

MAX_IMAGES = 4096  # ~14 KB each for the tiny base's 96 px mazes
# ~221 KB each (float patches); the repeats that matter are within a step: its prompts x num_generations, twice
MAX_PREPROCESSED = 256


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
        grids = grid_thw.tolist()
        keys: list[tuple] = []
        firsts: list[int] = []  # the first of each distinct image in this call
        for i, (image, row) in enumerate(zip(images, grids)):
            # a repeat of an image earlier in this call (GRPO's repeated prompts) is compared, not hashed; the
            # latest first: repeats are adjacent
            earlier = next((j for j in reversed(firsts) if grids[j] == row and torch.equal(images[j], image)), None)
            if earlier is None:
                firsts.append(i)
                keys.append((_digest(image.detach().contiguous().cpu().numpy()), tuple(row)))
            else:
                keys.append(keys[earlier])
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
        found = _take(self.entries, keys, self.max_images)
        return self.output_type(
            last_hidden_state=torch.cat([f[0] for f in found]), pooler_output=torch.cat([f[1] for f in found]),
            deepstack_features=[torch.cat([f[2][d] for f in found]) for d in range(len(found[0][2]))])


class _DuringSteps(TrainerCallback):
    """A processor wrapper (its `attach` and `detach`) in place only inside training steps: a checkpoint,
    saved between steps, saves the stock processor (its config is its attributes, which a wrapper would join)."""

    def on_step_begin(self, args, state, control, **kwargs):
        self.attach()

    def on_step_end(self, args, state, control, **kwargs):
        self.detach()


class PixelCache(_DuringSteps):
    """Wraps an image processor's `preprocess` for lists of PIL images (nested per prompt, as processors take
    them), for processors that answer with tensors: each distinct image (by its pixels and the call's
    settings) is resized and patched once; any other input or output goes through as it is. Attached inside
    training steps only."""

    def __init__(self, image_processor, max_images: int = MAX_PREPROCESSED):
        self.image_processor, self.preprocess, self.max_images = image_processor, image_processor.preprocess, max_images
        self.entries: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    def attach(self) -> None:
        self.image_processor.preprocess = self.__call__

    def detach(self) -> None:
        self.image_processor.__dict__.pop("preprocess", None)

    def __call__(self, images, *args, **kwargs):
        flat = _flatten(images)
        if args or kwargs.get("return_tensors") not in (None, "pt") or not flat or not all(isinstance(i, Image.Image) for i in flat):
            return self.preprocess(images, *args, **kwargs)
        settings = repr(sorted((k, v) for k, v in kwargs.items() if k != "return_tensors"))
        keys = [(_digest(image.tobytes()), image.mode, image.size, settings) for image in flat]
        missing = {key: image for key, image in zip(keys, flat) if key not in self.entries}
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        if missing:
            out = self.preprocess(list(missing.values()), **kwargs)
            if set(out) != {"pixel_values", "image_grid_thw"} or not all(isinstance(v, torch.Tensor) for v in out.values()):
                return self.preprocess(images, **kwargs)  # more outputs per image, or not tensors
            sizes = out["image_grid_thw"].prod(-1).tolist()
            for key, pixels, grid in zip(missing, torch.split(out["pixel_values"], sizes), out["image_grid_thw"]):
                self.entries[key] = (pixels, grid)
        found = _take(self.entries, keys, self.max_images)
        return BatchFeature({"pixel_values": torch.cat([f[0] for f in found]),
                             "image_grid_thw": torch.stack([f[1] for f in found])},
                            tensor_type=kwargs.get("return_tensors"))


class SharedImage(Image.Image):
    """A picture that deep-copies as itself. TRL deep-copies each step's prompts, images included, before it
    processes them; nothing writes to these, so a prompt's repeats keep one image object (`shared`)."""

    def __deepcopy__(self, memo: dict) -> "SharedImage":
        return self


def shared(image: Image.Image) -> SharedImage:
    image.__class__ = SharedImage
    return image


class DistinctRows(_DuringSteps):
    """Processes each distinct (text, image objects) row of a processor call once and assembles the batch from
    them: the tensors and lists the processor itself answers (padding depends only on the longest row, which
    is among the distinct ones). Images are told apart by identity, which is safe within one call (all are
    alive) and what GRPO's repeats of a `shared` image have. TRL asks for a step's rows twice (the chat
    template's lists for generation, padded tensors for the loss): the distinct rows are processed once, as
    padded tensors, and kept for the step; the lists are those rows without their padding. Calls it cannot
    split that way (other inputs or outputs, no repeats) go through as they are. Attached inside training
    steps only, by swapping the processor's class: `processor(...)` looks `__call__` up on the class."""

    ROW_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids"})
    IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})
    # the answers it assembles, by (return_tensors, padding) asked: unpadded lists, or tensors padded to the longest
    FORMS = {(None, False): "lists", (None, "do_not_pad"): "lists", ("pt", True): "tensors", ("pt", "longest"): "tensors"}

    def __init__(self, processor):
        self.processor, self.stock = processor, type(processor)
        self.deduplicating = type(self.stock.__name__, (self.stock,), {
            "__call__": lambda processor, *args, **kwargs: self._call(processor, *args, **kwargs)})
        self.rows = self.processed = 0
        self.last: tuple | None = None  # (key, the rows' images, their padded tensors): the step's distinct rows

    def attach(self) -> None:
        self.processor.__class__ = self.deduplicating

    def detach(self) -> None:
        self.processor.__class__ = self.stock
        self.last = None

    def _call(self, processor, *args, **kwargs):
        stock = self.stock.__call__
        images, text = kwargs.get("images"), kwargs.get("text")
        if (args or kwargs.get("videos") is not None or kwargs.get("audio") is not None
                or not isinstance(text, list) or not isinstance(images, list) or len(images) != len(text)
                or not all(isinstance(t, str) for t in text)
                or not all(isinstance(row, list) and all(isinstance(i, Image.Image) for i in row) for row in images)):
            return stock(processor, *args, **kwargs)
        form = self.FORMS.get((kwargs.get("return_tensors"), kwargs.get("padding", False)))
        keys = [(t, tuple(map(id, row))) for t, row in zip(text, images)]
        firsts: dict[tuple, int] = {}
        for i, key in enumerate(keys):
            firsts.setdefault(key, i)
        if form is None or len(firsts) == len(keys):
            return stock(processor, **kwargs)
        distinct = list(firsts.values())
        settings = {k: v for k, v in kwargs.items() if k not in ("images", "text", "videos", "audio", "return_tensors", "padding")}
        out = self._padded(processor, [text[i] for i in distinct], [images[i] for i in distinct], settings)
        if (not set(out) <= self.ROW_KEYS | self.IMAGE_KEYS or ("pixel_values" in out) != ("image_grid_thw" in out)
                or "attention_mask" not in out):
            return stock(processor, **kwargs)
        self.rows += len(keys)
        slot = {key: j for j, key in enumerate(firsts)}
        order = [slot[key] for key in keys]  # each row's distinct row
        counts = [len(images[i]) for i in distinct]
        starts = [sum(counts[:j]) for j in range(len(counts))]
        picked = [starts[j] + k for j in order for k in range(counts[j])]  # image indices in batch order
        unpadded = out["attention_mask"].bool()
        data = {}
        for name, value in out.items():
            if name == "pixel_values":
                pixels = torch.split(value, out["image_grid_thw"].prod(-1).tolist())
                data[name] = torch.cat([pixels[i] for i in picked])
            elif name == "image_grid_thw":
                data[name] = value[torch.tensor(picked)]
            elif form == "tensors":
                data[name] = value[torch.tensor(order)]
            else:
                rows = [row[mask].tolist() for row, mask in zip(value, unpadded)]
                data[name] = [rows[j] for j in order]
        return BatchFeature(data)

    def _padded(self, processor, text: list[str], images: list[list], settings: dict) -> BatchFeature:
        """The stock processor's padded tensors for these rows, kept until the next rows or the step's end
        (the images kept with them, so their ids stay theirs)."""
        key = (text, [tuple(map(id, row)) for row in images], repr(sorted(settings.items())))
        if self.last is None or self.last[0] != key:
            out = self.stock.__call__(processor, text=text, images=images, padding=True, return_tensors="pt", **settings)
            self.processed += len(text)
            self.last = (key, images, out)
        return self.last[2]


def _take(entries: OrderedDict, keys: list, max_entries: int) -> list:
    """The entries of `keys` (all present), marked as just used; then the least recently used beyond
    `max_entries` are dropped."""
    found = []
    for key in keys:
        entries.move_to_end(key)
        found.append(entries[key])
    while len(entries) > max_entries:
        entries.popitem(last=False)
    return found


def _flatten(images) -> list:
    if isinstance(images, (list, tuple)):
        return [leaf for part in images for leaf in _flatten(part)]
    return [images]


def _digest(data) -> bytes:
    """sha256 over the buffer (hardware-accelerated here: ~2.5x blake2b on a GRPO batch's pixels)."""
    return hashlib.sha256(memoryview(data).cast("B")).digest()
