"""A tiny random-init Qwen3-VL built entirely offline: the default base of the local CPU trainer.

Architecture and code paths are the real `Qwen3VLForConditionalGeneration` (vision tower with deepstack,
M-RoPE, chat template with image tokens); only the sizes are tiny (~0.44M parameters) and the tokenizer is
a word-level vocabulary of the maze prompts, trained-free with `tokenizers`. The folder loads with
`from_pretrained` and the stock `AutoProcessor` under `HF_HUB_OFFLINE=1`, and vLLM serves it on CPU.
"""
from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
UNK_TOKEN = "[UNK]"
# Every word of the maze prompts, actions and feedback (tasks.maze.env); anything else maps to [UNK].
WORDS = [
    "system", "user", "assistant",
    "right", "up", "left", "down", "stop", "move",
    "you", "are", "the", "a", "an", "to", "in", "on", "of", "is", "with", "then", "and", "or", "at", "into",
    "blue", "red", "circle", "square", "agent", "target", "maze", "goal", "wall", "walls", "gray", "white",
    "answer", "moves", "action", "actions", "one", "per", "turn", "step", "steps", "reach", "say",
    "navigate", "cannot", "parse", "string", "executed", "successfully", "reached", "not", "invalid",
    "(", ")", ",", "'", ".", ":", "_", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
]
TEXT_HEAD_DIM = 32  # the smallest head size vLLM's CPU attention supports
IMAGE_SIDE_PX = 96  # the processor resizes every maze image to at most this square: 9 image tokens (128 px learnt worse)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A word-level fast tokenizer over SPECIAL_TOKENS + WORDS with the Qwen-style chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, UNK_TOKEN, *WORDS]:
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins words with spaces (no token carries the "##" prefix).
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token=UNK_TOKEN, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_processor():
    """The stock `Qwen3VLProcessor`: what vLLM and `AutoProcessor` load from the folder. The video processor
    is never used by the maze task, but the processor class always has one and vLLM builds it."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    sizes = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    max_pixels = IMAGE_SIDE_PX * IMAGE_SIDE_PX
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": max_pixels}, **sizes)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 2 * max_pixels}, **sizes)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                            video_processor=video_processor, chat_template=CHAT_TEMPLATE)


def tiny_config(tokenizer):
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            # vLLM's CPU attention needs head_dim >= 32; 4 heads x 32 (over hidden 64) learns best here at
            # SFT lr 7e-4 (bench/README.md: the sweep). The vision tower's attention is not constrained.
            num_attention_heads=4, num_key_value_heads=2, head_dim=TEXT_HEAD_DIM, max_position_embeddings=1024,
            # M-RoPE splits head_dim/2 frequencies over (time, height, width): [8, 4, 4].
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                             "mrope_section": [TEXT_HEAD_DIM // 4, TEXT_HEAD_DIM // 8, TEXT_HEAD_DIM // 8]},
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=64,
            num_position_embeddings=(IMAGE_SIDE_PX // 16) ** 2, deepstack_visual_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def architecture_digest() -> str:
    """sha256 of what `build_tiny_vlm` writes besides the weights (model config, processor, vocabulary), so
    that a cached build from an older version of this module can be told apart and rebuilt."""
    import hashlib
    import json

    processor = build_processor()
    parts = [tiny_config(processor.tokenizer).to_json_string(use_diff=False), processor.to_json_string(),
             json.dumps(processor.tokenizer.get_vocab(), sort_keys=True), CHAT_TEMPLATE]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def build_tiny_vlm(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random-init Qwen3-VL (config, weights, tokenizer, processor) to `out_dir`; return it.

    Deterministic for a given seed. Loadable offline with `Qwen3VLForConditionalGeneration.from_pretrained`
    and `AutoProcessor.from_pretrained`.
    """
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor = build_processor()
    tokenizer = processor.tokenizer
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3VLForConditionalGeneration(tiny_config(tokenizer))
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
