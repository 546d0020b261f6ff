"""The vision tower of a vision-language model's probe, shrunk in size only (``shrink.shrink_config`` calls it).

What decides how images become tokens and positions is kept: patch and image sizes, spatial merge, temporal patch,
window sizes in pixels, learned position grids, tokens per image, the feature layer read. Changed: the tower's
width (heads near 2 of dimension near 16, widths and MLP by the same ratio, a head dimension kept a multiple of 4
for the rotary halves of Qwen's towers), its outputs sized to the shrunk language model (a vision field equal to
the language model's hidden size is that projection), and its depth: layers named by index lists (Qwen2.5-VL's
full-attention blocks, Qwen3-VL's deepstack taps) are kept one apart with a plain layer before each, so every kind
of block stays, in order; a negative ``vision_feature_layer`` still names a layer.
"""

from __future__ import annotations

import math

_TARGET_HEADS, _TARGET_DIM, _ALIGN = 2, 16, 8
_WIDTHS = ("embed_dim", "hidden_size")  # the tower's own width (Qwen2-VL: embed_dim; hidden_size is its output)
_HEADS = ("num_heads", "num_attention_heads")
_DEPTHS = ("depth", "num_hidden_layers")
_MLP = ("intermediate_size",)


def vision_keys(config, d: dict) -> list[str]:
    """The sub-configs of ``config`` that are vision towers (``vision_config``)."""
    return [k for k, sub in vars(config).items()
            if "vision" in k and hasattr(sub, "model_type") and isinstance(d.get(k), dict)]


def _closest_divisor(n: int, target: int, ok=lambda d: True) -> int:
    options = [x for x in range(1, n + 1) if n % x == 0 and ok(x)] or [n]
    return min(options, key=lambda x: (abs(math.log(x / target)), x))


def shrink_vision(v: dict, top: dict, text_hidden: tuple[int, int], facts: dict, name: str) -> None:
    """Shrink the vision table ``v`` in place; ``top``: the whole config's table (``vision_feature_layer``);
    ``text_hidden``: the language model's (old, new) hidden size."""
    width_key = next((k for k in _WIDTHS if isinstance(v.get(k), int)), None)  # embed_dim first (Qwen2-VL)
    heads_key = next((k for k in _HEADS if isinstance(v.get(k), int)), None)
    before = {k: v[k] for k in (*_WIDTHS, *_HEADS, *_DEPTHS, *_MLP) if isinstance(v.get(k), int)}
    if width_key is not None and heads_key is not None and v[width_key] % v[heads_key] == 0:
        width, heads = v[width_key], v[heads_key]
        head_dim = width // heads
        new_heads = _closest_divisor(heads, _TARGET_HEADS)
        new_dim = head_dim // _closest_divisor(head_dim, max(1, head_dim // _TARGET_DIM),
                                               lambda x: head_dim // x % 4 == 0 or head_dim % 4)
        new_width = new_heads * new_dim
        ratio = width / new_width
        for k, value in list(v.items()):
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if k == width_key:
                v[k] = new_width
            elif k == heads_key:
                v[k] = new_heads
            elif value == text_hidden[0] and k in ("hidden_size", "out_hidden_size"):
                v[k] = text_hidden[1]
            elif k in _MLP:
                v[k] = max(_ALIGN, -(-int(value / ratio) // _ALIGN) * _ALIGN)
    depth_key = next((k for k in _DEPTHS if isinstance(v.get(k), int)), None)
    if depth_key is not None:
        depth = v[depth_key]
        lists = [k for k, x in v.items() if isinstance(x, list) and x and all(isinstance(i, int) and 0 <= i < depth
                                                                               for i in x)
                 and k.endswith(("indexes", "indices", "idxs", "layers"))]
        marked = sorted({i for k in lists for i in v[k]})
        new_at = {i: 2 * rank + 1 for rank, i in enumerate(marked)}
        feature = top.get("vision_feature_layer")
        features = feature if isinstance(feature, list) else [feature] if isinstance(feature, int) else []
        need = max([2 * len(marked) + (1 if marked and marked[-1] < depth - 1 else 0), 2]
                   + [-f + 1 for f in features if f < 0] + [f + 1 for f in features if f >= 0])
        if need < depth:
            for k in lists:
                v[k] = [new_at[i] for i in v[k]]
            v[depth_key] = need
    facts[name] = {"from": before, "to": {k: v[k] for k in before}}
