"""Decoding for the tiny Qwen3-VL outside HF's generation loop. For a model this small (two text layers) a
decode step through `generate` is almost all Python: the model's forward with its masks and 3D positions,
the LoRA wrappers, the cache and the logits processors. Here the text layers are written out as plain
tensor ops on their weights, LoRA deltas merged once per call: the prompt is prefilled through them with
HF's own vision tower, deepstack placement, M-RoPE positions and mask (`text_pass`, which the GRPO loss's
forward shares), and the tokens after it are decoded one at a time. Past the prompt every token is text, so
its three M-RoPE positions are equal and the rotation is the ordinary 1D one."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers.masking_utils import create_causal_mask


class LeanDecoder:
    """Replaces a Qwen3-VL model's `generate` for greedy or plain temperature sampling (the GRPO rollouts'
    and the local eval's settings); any other generation setting goes to the original `generate`."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.fallback = model, model.generate
        self.calls = self.fallbacks = 0

    @classmethod
    def install(cls, model: torch.nn.Module) -> "LeanDecoder":
        decoder = cls(model)
        model.generate = decoder.generate
        return decoder

    @staticmethod
    def supported(config, kwargs: dict) -> bool:
        """Greedy, or sampling at a temperature from the full distribution, with nothing else changing it."""
        if set(kwargs) - {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"}:
            return False
        if (config.num_beams or 1) != 1 or (config.num_return_sequences or 1) != 1 or config.min_new_tokens or config.min_length:
            return False
        if config.do_sample and ((config.top_k or 0) > 0 or (config.top_p or 1.0) < 1.0 or config.min_p
                                 or config.typical_p not in (None, 1.0) or config.epsilon_cutoff or config.eta_cutoff):
            return False
        return (config.repetition_penalty in (None, 1.0) and not config.bad_words_ids and not config.sequence_bias
                and config.no_repeat_ngram_size in (None, 0) and not config.forced_bos_token_id
                and not config.forced_eos_token_id and not config.begin_suppress_tokens
                and config.max_new_tokens is not None and config.stop_strings is None)

    def generate(self, generation_config=None, **kwargs):
        config = self.model.generation_config if generation_config is None else generation_config
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        settings = {k: v for k, v in kwargs.items() if k not in tensors}
        if settings:
            config = copy.deepcopy(config)
            settings = config.update(**settings)  # what is not a generation setting stays: the fallback takes it
        if settings or not self.supported(config, tensors) or not implements(self.model):
            self.fallbacks += 1
            return self.fallback(generation_config=generation_config, **kwargs)
        self.calls += 1
        with torch.no_grad():
            return self._decode(config, **tensors)

    def _distinct(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, multimodal: dict) -> tuple:
        """The prompt rows to prefill (GRPO repeats each prompt `num_generations` times: a repeat is the same
        tokens and the same images) and, per row, which of them it is."""
        everything = torch.arange(len(input_ids))
        whole = {"input_ids": input_ids, "attention_mask": attention_mask, **multimodal}
        images = self._images_per_row(input_ids, multimodal)
        if images is None:
            return everything, whole
        firsts: list[int] = []
        rows = []
        for r in range(len(input_ids)):
            same = next((i for i, f in reversed(list(enumerate(firsts))) if torch.equal(input_ids[r], input_ids[f])
                         and torch.equal(attention_mask[r], attention_mask[f]) and len(images[r]) == len(images[f])
                         and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(images[r], images[f]))),
                        None)
            if same is None:
                same = len(firsts)
                firsts.append(r)
            rows.append(same)
        if len(firsts) == len(input_ids):
            return everything, whole
        picked = torch.tensor(firsts)
        distinct = {k: v[picked] for k, v in whole.items() if k not in ("pixel_values", "image_grid_thw")}
        if "pixel_values" in multimodal:
            distinct["pixel_values"] = torch.cat([p for f in firsts for p, _ in images[f]])
            distinct["image_grid_thw"] = torch.stack([g for f in firsts for _, g in images[f]])
        return torch.tensor(rows), distinct

    def _images_per_row(self, input_ids: torch.Tensor, multimodal: dict) -> list[list[tuple]] | None:
        """Each row's images as (patches, grid) pairs, from how many image tokens each row holds; None where
        that cannot be told (videos, or an input this reading does not understand)."""
        if set(multimodal) - {"pixel_values", "image_grid_thw", "mm_token_type_ids"}:
            return None
        if "pixel_values" not in multimodal:
            return [[] for _ in input_ids]
        grids = multimodal["image_grid_thw"]
        merge = self.model.model.visual.spatial_merge_size ** 2
        patches = torch.split(multimodal["pixel_values"], grids.prod(-1).tolist())
        tokens = (grids.prod(-1) // merge).tolist()
        wanted = (input_ids == self.model.config.image_token_id).sum(-1).tolist()
        out, image = [], 0
        for count in wanted:
            row = []
            while count > 0 and image < len(tokens):
                row.append((patches[image], grids[image]))
                count -= tokens[image]
                image += 1
            if count != 0:
                return None
            out.append(row)
        return out if image == len(tokens) else None

    def _decode(self, config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **multimodal):
        text_config = self.model.config.get_text_config()
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        batch, prompt_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, distinct = self._distinct(input_ids, attention_mask, multimodal)
        weights = text_weights(self.model)
        hidden, prompt_cache = text_pass(self.model, weights, **distinct)
        # the next token's position: one past the prompt's largest (3D) position, per sequence
        position = attention_mask.sum(-1)
        if multimodal.get("image_grid_thw") is not None:
            position = position + self.model.model.rope_deltas.view(-1)[rows]
        steps = config.max_new_tokens
        total = prompt_len + steps
        keys, values = [], []
        for prompt_keys, prompt_values in prompt_cache:
            k = prompt_keys.new_zeros(batch, prompt_keys.shape[1], total, head_dim)
            v = torch.zeros_like(k)
            k[:, :, :prompt_len], v[:, :, :prompt_len] = prompt_keys[rows], prompt_values[rows]
            keys.append(k)
            values.append(v)
        visible = torch.zeros(batch, 1, 1, total, dtype=torch.bool)
        visible[:, 0, 0, :prompt_len] = attention_mask.bool()
        eos = torch.tensor(_as_list(config.eos_token_id))
        suppress = _as_list(config.suppress_tokens)
        pad = config.pad_token_id if config.pad_token_id is not None else int(eos[0])
        done = torch.zeros(batch, dtype=torch.bool)
        tokens = input_ids.new_full((batch, steps), pad)
        logits = F.linear(hidden[rows, -1], weights["lm_head"]).float()
        eps = text_config.rms_norm_eps
        for step in range(steps):
            if suppress:
                logits[:, suppress] = float("-inf")
            if config.do_sample:
                chosen = torch.multinomial(torch.softmax(logits / (config.temperature or 1.0), dim=-1), 1).squeeze(1)
            else:
                chosen = logits.argmax(-1)
            chosen = torch.where(done, pad, chosen)
            tokens[:, step] = chosen
            done = done | torch.isin(chosen, eos)
            if bool(done.all()) or step == steps - 1:
                return torch.cat([input_ids, tokens[:, :step + 1]], dim=1)
            slot = prompt_len + step
            visible[:, 0, 0, slot] = True
            logits = self._step(weights, chosen, position + step, keys, values, visible[..., :slot + 1], slot,
                                head_dim, eps)
        return torch.cat([input_ids, tokens], dim=1)

    @staticmethod
    def _step(weights: dict, token: torch.Tensor, position: torch.Tensor, keys: list, values: list,
              visible: torch.Tensor, slot: int, head_dim: int, eps: float) -> torch.Tensor:
        """One decode token per sequence through the text layers; its keys and values go into `slot`."""
        batch = token.shape[0]
        freqs = position.float()[:, None] * weights["inv_freq"][None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [batch, 1 (any head), head_dim]
        cos, sin = angles.cos(), angles.sin()
        x = weights["embed"][token]
        for layer, k_cache, v_cache in zip(weights["layers"], keys, values):
            heads, rotated = layer["heads"], layer["heads"] + layer["kv_heads"]
            qkv = F.linear(_rms(x, layer["ln1"], eps), layer["qkv"]).view(batch, -1, head_dim)
            qk = _rms(qkv[:, :rotated], layer["qk_norm"], eps)
            qk = qk * cos + _rotate_half(qk) * sin
            k_cache[:, :, slot], v_cache[:, :, slot] = qk[:, heads:], qkv[:, rotated:]
            attended = F.scaled_dot_product_attention(qk[:, :heads, None], k_cache[:, :, :slot + 1],
                                                      v_cache[:, :, :slot + 1], attn_mask=visible, enable_gqa=True)
            x = x + F.linear(attended.reshape(batch, -1), layer["o"])
            gate, up = F.linear(_rms(x, layer["ln2"], eps), layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(_rms(x, weights["norm"], eps), weights["lm_head"]).float()


def implements(model: torch.nn.Module) -> bool:
    """A Qwen3-VL on CPU whose text layers are the ones written out here: no biases, SiLU, plain RoPE, and LoRA
    adapters (if any) without dropout where their deltas merge into the weights (the text layers, the head) and
    none on the token embeddings, whose weight a decode step reads as it is. The vision tower is HF's own call."""
    if model.config.model_type != "qwen3_vl" or model.device.type != "cpu":
        return False
    text = model.config.get_text_config()
    if getattr(text, "attention_dropout", 0.0):
        return False
    text_model = model.model.language_model
    merged = [m for layer in text_model.layers for m in layer.modules()] + [model.lm_head]
    dropouts = [d for m in merged for d in getattr(m, "lora_dropout", {}).values()]
    return (not getattr(text, "attention_bias", False) and text.hidden_act == "silu"
            and (text.rope_parameters or {}).get("rope_type", "default") == "default"
            and getattr(text_model.embed_tokens, "base_layer", None) is None
            and all(isinstance(d, torch.nn.Identity) for d in dropouts))


def text_weights(model: torch.nn.Module) -> dict:
    """The text layers' effective weights: each LoRA-wrapped projection's base weight plus its active adapters'
    deltas (nothing added while adapters are disabled, e.g. for a reference forward). Differentiable: built
    with gradients on, the adapters get theirs through them."""
    def effective(module: torch.nn.Module) -> torch.Tensor:
        base = getattr(module, "base_layer", None)
        if base is None:
            return module.weight
        if module.disable_adapters or module.merged:
            return base.weight
        weight = base.weight
        for name in module.active_adapters:
            if name in module.lora_A:
                weight = weight + module.get_delta_weight(name)
        return weight

    text = model.model.language_model
    layers = []
    for layer in text.layers:
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        layers.append({
            "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
            # q, k and v in one product; the per-head norms and the rotation over q and k heads at once
            "qkv": torch.cat([effective(attn.q_proj), effective(attn.k_proj), effective(attn.v_proj)]),
            "qk_norm": torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)]),
            "heads": heads, "kv_heads": kv_heads,
            "o": effective(attn.o_proj), "down": effective(mlp.down_proj),
            "gate_up": torch.cat([effective(mlp.gate_proj), effective(mlp.up_proj)]),
        })
    return {"embed": text.embed_tokens.weight, "layers": layers, "norm": text.norm.weight,
            "lm_head": effective(model.lm_head), "inv_freq": text.rotary_emb.inv_freq}


def text_pass(model: torch.nn.Module, weights: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
              mm_token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Whole rows (prompts, or prompts and their completions) through the text layers written out with
    `weights`: the final norm's hidden states and each layer's keys (normed, rotated) and values, [batch,
    kv heads, tokens, head dim]. The vision tower, the placement of its features, the M-RoPE positions (which
    leave `rope_deltas` on the model, as HF's forward does), the rotary tables and the mask are HF's own calls."""
    inner, config = model.model, model.config.get_text_config()
    text = inner.language_model
    x = text.embed_tokens(input_ids)
    visual, deepstack = None, []
    if pixel_values is not None:
        image = inner.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        features = torch.cat(image.pooler_output).to(x.dtype)
        placement, _ = inner.get_placeholder_mask(input_ids, inputs_embeds=x, image_features=features)
        x = x.masked_scatter(placement, features)
        visual = placement[..., 0]
        deepstack = [torch.cat(level) for level in image.deepstack_features]
    positions = inner.compute_3d_position_ids(input_ids=input_ids, inputs_embeds=x, image_grid_thw=image_grid_thw,
                                              attention_mask=attention_mask, mm_token_type_ids=mm_token_type_ids)
    if positions is None:  # text only: HF's own default
        positions = torch.arange(x.shape[1]).view(1, 1, -1).expand(3, x.shape[0], -1)
    mask = create_causal_mask(config=text.config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                              position_ids=None)
    cos, sin = text.rotary_emb(x, positions)
    cos, sin = cos[:, :, None], sin[:, :, None]  # [batch, tokens, 1 (any head), head_dim]
    batch, tokens = input_ids.shape
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eps = config.rms_norm_eps
    cached = []
    for index, layer in enumerate(weights["layers"]):
        heads, rotated = layer["heads"], layer["heads"] + layer["kv_heads"]
        qkv = F.linear(_rms(x, layer["ln1"], eps), layer["qkv"]).view(batch, tokens, -1, head_dim)
        qk = _rms(qkv[:, :, :rotated], layer["qk_norm"], eps)
        qk = (qk * cos + _rotate_half(qk) * sin).transpose(1, 2)
        keys, values = qk[:, heads:], qkv[:, :, rotated:].transpose(1, 2)
        cached.append((keys, values))
        attended = F.scaled_dot_product_attention(qk[:, :heads], keys, values, attn_mask=mask,
                                                  is_causal=mask is None, enable_gqa=True)
        x = x + F.linear(attended.transpose(1, 2).reshape(batch, tokens, -1), layer["o"])
        gate, up = F.linear(_rms(x, layer["ln2"], eps), layer["gate_up"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer["down"])
        if index < len(deepstack):  # HF's deepstack: the tower's level `index` added at the image tokens
            x = x.clone()
            x[visual] = x[visual] + deepstack[index].to(x.dtype)
    return _rms(x, weights["norm"], eps), cached


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
