"""The GRPO loss's forward for the tiny Qwen3-VL outside HF's text modules. A step scores 32 rows of a few
dozen tokens through two text layers, and HF's forward of that is almost all per-op overhead, forward and
backward: each LoRA projection is five ops and PEFT's Python, q, k and v three products, each norm six ops.
Here each projection's LoRA delta is merged into its weight once per forward (differentiably: the adapters
get their gradients through the merged weights), q, k and v are one product, and the labels are scored with
one log-softmax over the small vocabulary (`lean_decode.text_pass`, which the decoder's prefill shares)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from training.lean_decode import implements, text_pass, text_weights

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

        @functools.wraps(loss.fused)  # the model's own signature: HF's generate reads which inputs it takes from it
        def forward(*args, **kwargs):
            return loss.forward(*args, **kwargs)

        model.forward = forward
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

    def _forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs):
        # imported here, as the trainer imports TRL: its first import changes os.environ (`local_trainer.environ_kept`)
        from trl.trainer.utils import FusedCausalLMOutput

        weights = text_weights(self.model)
        hidden, _ = text_pass(self.model, weights, input_ids, **inputs)
        logits = F.linear(hidden[:, :-1], weights["lm_head"]).float() / self.temperature
        log_p = logits.log_softmax(-1)
        targets = labels[:, 1:]
        scored = targets != -100
        log_probs = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~scored, 0)
        entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~scored, 0)
        return FusedCausalLMOutput(loss=-log_probs.sum() / scored.sum().clamp(min=1), log_probs=log_probs,
                                   entropy=entropy, label_mask=scored)
