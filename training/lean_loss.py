"""The GRPO loss's forward for the tiny Qwen3-VL outside HF's text modules. A step scores 32 rows of a few
dozen tokens through two text layers, and HF's forward of that is almost all per-op overhead, forward and
backward: each LoRA projection is five ops and PEFT's Python, q, k and v three products, each norm six ops.
Here each projection's LoRA delta is merged into its weight once per forward (differentiably: the adapters
get their gradients through the merged weights), q, k and v are one product, and the labels are scored with
one log-softmax over the small vocabulary. The vision tower, the placement of its features, the M-RoPE
positions and tables and the attention mask are HF's own calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.masking_utils import create_causal_mask
from trl.trainer.utils import FusedCausalLMOutput

from training.lean_decode import _rms, _rotate_half, implements, text_weights

INPUTS = frozenset({"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"})


class LeanLoss:
    """Wraps a Qwen3-VL model's forward as TRL's fused LM head left it (`model(..., labels=..., fused_lm_head=True)`
    answers per-token log-probs and entropies at the trainer's temperature) and answers those calls itself;
    any other call, input or model goes to the wrapped forward. `calls` and `fallbacks` count the fused calls."""

    def __init__(self, model: torch.nn.Module, temperature: float):
        self.model, self.fused, self.temperature = model, model.forward, temperature
        self.calls = self.fallbacks = 0

    @classmethod
    def install(cls, model: torch.nn.Module, temperature: float) -> "LeanLoss":
        """`model` is the HF Qwen3-VL TRL added its fused head to (the PEFT model's base model)."""
        loss = cls(model, temperature)
        model.forward = loss.forward
        return loss

    def forward(self, *args, fused_lm_head: bool = False, labels=None, **kwargs):
        if not fused_lm_head:
            return self.fused(*args, labels=labels, **kwargs)
        given = {k: v for k, v in kwargs.items() if v is not None}
        text = self.model.config.get_text_config()
        if (args or labels is None or set(given) - INPUTS or "input_ids" not in given
                or ("pixel_values" in given) != ("image_grid_thw" in given) or not implements(self.model)
                or getattr(text, "final_logit_softcapping", None) is not None
                or getattr(text, "logit_scale", None) not in (None, 1.0)):
            self.fallbacks += 1
            return self.fused(*args, fused_lm_head=True, labels=labels, **kwargs)
        self.calls += 1
        return self._forward(labels=labels, **given)

    def _forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 mm_token_type_ids: torch.Tensor | None = None) -> FusedCausalLMOutput:
        inner, text_config = self.model.model, self.model.config.get_text_config()
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
        if positions is None:  # text only, no padding information: HF's own default
            positions = torch.arange(x.shape[1]).view(1, 1, -1).expand(3, x.shape[0], -1)
        mask = create_causal_mask(config=text.config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                                  position_ids=None)
        cos, sin = text.rotary_emb(x, positions)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [batch, tokens, 1 (any head), head_dim]
        weights = text_weights(self.model)
        batch, tokens = input_ids.shape
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        eps = text_config.rms_norm_eps
        for index, layer in enumerate(weights["layers"]):
            heads, rotated = layer["heads"], layer["heads"] + layer["kv_heads"]
            qkv = F.linear(_rms(x, layer["ln1"], eps), layer["qkv"]).view(batch, tokens, -1, head_dim)
            qk = _rms(qkv[:, :, :rotated], layer["qk_norm"], eps)
            qk = (qk * cos + _rotate_half(qk) * sin).transpose(1, 2)
            values = qkv[:, :, rotated:].transpose(1, 2)
            attended = F.scaled_dot_product_attention(qk[:, :heads], qk[:, heads:], values, attn_mask=mask,
                                                      is_causal=mask is None, enable_gqa=True)
            x = x + F.linear(attended.transpose(1, 2).reshape(batch, tokens, -1), layer["o"])
            gate, up = F.linear(_rms(x, layer["ln2"], eps), layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
            if index < len(deepstack):  # HF's deepstack: the tower's level `index` added at the image tokens
                x = x.clone()
                x[visual] = x[visual] + deepstack[index].to(x.dtype)
        logits = F.linear(_rms(x[:, :-1], weights["norm"], eps), weights["lm_head"]).float() / self.temperature
        log_p = logits.log_softmax(-1)
        targets = labels[:, 1:]
        scored = targets != -100
        log_probs = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~scored, 0)
        entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~scored, 0)
        return FusedCausalLMOutput(loss=-log_probs.sum() / scored.sum().clamp(min=1), log_probs=log_probs,
                                   entropy=entropy, label_mask=scored)
