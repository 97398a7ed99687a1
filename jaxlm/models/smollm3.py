"""SmolLM3: Llama with rope left out of some layers ("NoPE" layers).

``no_rope_layers[i]`` is 1 where layer i uses rope (transformers' naming); configs without the
list derive it from ``no_rope_layer_interval``: every interval-th layer has none. A sliding
window applies only with ``use_sliding_window``, on the layers ``layer_types`` marks sliding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlm.models.llama import LlamaArgs, LlamaForCausalLM
from jaxlm.models.rotary import RotaryEmbedding


def rope_layers(config: Any) -> tuple[bool, ...]:
    """Per layer: whether it applies rope."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        interval = getattr(config, "no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config no_rope_layer_interval={interval!r}: must be an integer >= 1")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return tuple(bool(f) for f in flags)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_args(cls, config: Any) -> LlamaArgs:
        args = super().make_args(config)
        if not getattr(config, "use_sliding_window", False):
            args = dataclasses.replace(args, sliding_windows=(None,) * args.num_layers)
        return args

    def layer_ropes(self, config: Any) -> tuple[RotaryEmbedding | None, ...]:
        rope = super().layer_ropes(config)[0]
        return tuple(rope if use else None for use in rope_layers(config))
