"""The probe's model: the user's model class on the user's config, shrunk in size only.

The probe (``measure``) measures whether a batch layout is exact on a tiny copy of the user's model, so the copy
must compute the way the real model does: ``shrink_config`` changes sizes and nothing else. It edits the config's
``to_dict()`` and rebuilds it with the config's own class (the family's validation and derived fields apply):

* widths: head counts are divided by one factor, per-head dims by another (heads near 4, head dims near 16) and
  every width (hidden, MLP, expert, low-rank, SSM projection) by their product, so each linear relation of the
  family (hidden = heads x head_dim, Mamba2's expand x hidden = heads x head_dim, GQA groups) still holds. Lists
  per rotary frequency (LongRoPE factors, mrope sections) shrink with the head dim; partial rotary is kept.
* experts: max(4, 2 x top-k, 2 x expert groups); vocabulary: 256, special token ids moved inside it.
* layers: the layers of the full-depth model (built on the meta device) are told apart by module structure and
  attributes and by per-layer config values (``layer_types``, patterns, index lists, per-layer overrides); a
  selection keeping every kind replaces them if building it shows every kept layer unchanged.
* token-count thresholds (windows, attention chunks, sparse-attention top-k, LongRoPE's original length, dynamic
  NTK's length): one that can bind in the real run (``max_tokens`` None or longer) becomes ``PROBE_THRESHOLD``,
  inside the probe's sequences; one that cannot becomes 2 x ``PROBE_LENGTH``. LongRoPE keeps its length ratio.

Everything else (attention implementation, rope, layer types, ALiBi, softcapping, routing, dropout, layer-drop,
router jitter) is kept as it is.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from functools import reduce

import torch

from lightalign.modules.adaptations.shrink_vision import shrink_vision, vision_keys

PROBE_LENGTH = 48  # the longest probe sequence, tokens
PROBE_THRESHOLD = 12  # where a binding token-count threshold is put in the probe
_FAR = 2 * PROBE_LENGTH  # where a threshold that does not bind is put
_VOCAB, _STATE, _ALIGN = 256, 16, 8  # _ALIGN: MLP widths stay multiples of it (16-byte grouped-matmul strides)
_TARGETS, _BUDGET = ((4, 16), (2, 8)), 2_500_000  # (heads, head dim) tried in turn until under _BUDGET parameters

_COUNT = re.compile(r"heads(_per_layer)?$|^n_head$|(^|_)n_?groups$|^num_query_groups$")
_GROUPED = re.compile(r"(key_value|kv).*heads$|n_?groups$|^num_query_groups$")  # counts grouping other heads
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads")
_DIM = re.compile(r"(head_dim|head_size|d_head|dim_head|headdim|^kv_channels|^rotary_dim)$")
_WIDTH = re.compile(r"hidden_size|intermediate_size|ffn_dim|ffn_hidden_size|_embd$|^d_model$|^d_inner$|^dff$|^dim_ff$|"
                    r"feed_forward_size|_width$|^embedding_(size|dim)$|^emb_dim$|embed_proj_dim|_rank$|latent_size|"
                    r"^mamba_d_ssm$|^adapter_(in|out)(put)?_(dim|size)$|^axial_pos_embds_dim$")
_MLP = re.compile(r"intermediate|ffn|^n_inner$|^dff$|^dim_ff$|feed_forward")
_STATES = ("state_size", "ssm_state_size", "mamba_d_state", "d_state")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "moe_k", "top_k_experts")
_VOCABS = re.compile(r"(^|_)vocab(_size)?$|^vocab_size_per_layer_input$")  # incl. BLT's hash-embedding table
_TOKEN_ID = re.compile(r"_token_(id|ids|index)$")
_WINDOWS = ("sliding_window", "sliding_window_size", "window_size", "attention_window_size", "local_attention",
            "local_attention_window_len", "attention_chunk_size", "keep_window_size", "index_topk", "indexer_budget",
            "local_attn_chunk_length", "lsh_attn_chunk_length")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_blocks")
_INDEX_ATTR = re.compile(r"(^|_)(idx|index|id|number)$")  # a layer's own index: not part of its kind


def shrink_config(config, max_tokens: int | None, model_class=None):
    """``(shrunk, facts)``: a copy of ``config`` shrunk in size only, and what it kept as a JSON-serialisable dict
    for cache keys and messages. Each token-count threshold is an entry ``{"value": 4096, "binds": True}`` under
    its name (``"sliding_window"``, ``"text_config.attention_chunk_size"``, ...); the others are ``model_type``,
    ``config_class``, ``attn_implementation``, ``divisors``, ``experts``, the vocabulary sizes, ``layers`` and
    ``config_sha256`` (of the shrunk config).

    ``max_tokens``: the longest sequence of the real run, None if unknown. ``model_class``: the class the probe
    builds (default: transformers' causal-LM class for the config), used to tell layers apart and to count
    parameters, always at the shrunk size (the real-size model is never built)."""
    if model_class is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    for heads, head_dim in _TARGETS:
        facts: dict = {"model_type": config.model_type, "config_class": type(config).__name__,
                       "attn_implementation": config._attn_implementation}
        d = config.to_dict()
        towers = vision_keys(config, d)  # shrunk on their own (shrink_vision): widths, depth, outputs
        tables = [(p, t) for p, t in _tables(config, d) if not p.startswith(tuple(f"{k}." for k in towers))]
        text = _text_dict(config, d)
        hidden = next((text[k] for k in ("hidden_size", "n_embd", "d_model") if _is_int(text.get(k))), None)
        _shrink_sizes([t for _, t in tables], text, facts, heads, head_dim)
        for k in towers:
            new_hidden = next((text[k] for k in ("hidden_size", "n_embd", "d_model") if _is_int(text.get(k))), None)
            shrink_vision(d[k], d, (hidden, new_hidden), facts, k)
        _place_thresholds(tables, next(p for p, t in tables if t is text), max_tokens, facts)
        shrunk = _reduce_layers(config, _rebuild(config, d), d, model_class, facts)
        model = _structure(model_class, shrunk) if model_class is not None else None
        if model is None or sum(p.numel() for p in model.parameters()) <= _BUDGET:
            break
    kept = {k: v for k, v in shrunk.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    facts["config_sha256"] = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()
    return shrunk, facts


def probe_model(model_class, shrunk_config, seed: int = 0) -> torch.nn.Module:
    """``model_class`` on ``shrunk_config`` in float32 (its ``_attn_implementation`` kept), in eval mode, weights
    from the family's own init under ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(model_class, shrunk_config).eval()


def _build(model_class, config, **kwargs) -> torch.nn.Module:
    """``model_class`` in float32 on a copy of ``config``, or of its text config where that is what the class takes
    (as ``AutoModelForCausalLM.from_config`` does for multimodal configs)."""
    config = copy.deepcopy(config)
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) and isinstance(config.get_text_config(), wanted):
        config = config.get_text_config()
    return model_class._from_config(config, dtype=torch.float32, **kwargs)


def _structure(model_class, config) -> torch.nn.Module | None:
    """The shrunk model's structure, for counting and comparing: built on the meta device (with eager attention if
    its own cannot be set up here), else on the CPU; None if it cannot be built."""
    for device, kwargs in (("meta", {}), ("meta", {"attn_implementation": "eager"}), ("cpu", {})):
        try:
            with torch.device(device):
                return _build(model_class, config, **kwargs)
        except Exception:
            continue
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tables(config, d: dict, path: str = ""):
    """(path, dict) of the config, its per-layer overrides and its sub-configs (text, DBRX's attn_config, ...)."""
    yield path, d
    for key, override in (d.get("per_layer_config") or {}).items():
        yield f"{path}per_layer_config.{int(key)}.", override
    for key, sub in vars(config).items():
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type") and isinstance(d.get(key), dict):
            yield from _tables(sub, d[key], f"{path}{key}.")


def _text_dict(config, d: dict) -> dict:
    text = config.get_text_config(decoder=True)
    return next((d[k] for k, sub in vars(config).items() if sub is text and isinstance(d.get(k), dict)), d)


def _rope_dicts(t: dict) -> list[dict]:
    rope = t.get("rope_parameters") or t.get("rope_scaling")
    if not isinstance(rope, dict):
        return []
    return [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]


def _divisor(g: int, value: int, target: int, ok=lambda d: True) -> int:
    """The divisor of ``g`` that brings ``value`` closest to ``target`` (in ratio), among those ``ok`` allows."""
    options = [d for d in range(1, g + 1) if g % d == 0 and ok(d)] or [1]
    return min(options, key=lambda d: (abs(math.log(value / d / target)), d))


def _shrink_sizes(tables: list[dict], text: dict, facts: dict, heads_target: int, dim_target: int) -> None:
    def ints(pattern, grouped=None):
        return [x for t in tables for k, v in t.items() if pattern.search(k) and grouped in (None, bool(
            _GROUPED.search(k))) for x in (v if isinstance(v, list) else [v]) if _is_int(x) and x > 1]

    primary, dims, widths = ints(_COUNT, grouped=False), ints(_DIM), ints(_WIDTH)
    heads = next((text[k] for k in _HEADS if _is_int(text.get(k))), max(primary, default=None))
    hidden = next((text[k] for k in ("hidden_size", "n_embd", "d_model") if _is_int(text.get(k))), None)
    head_dim = text["head_dim"] if _is_int(text.get("head_dim")) else None
    if head_dim is None and heads and hidden and hidden % heads == 0:  # implicit: hidden / heads
        head_dim = hidden // heads
        dims.append(head_dim)
    ropes = [r for t in tables for r in _rope_dicts(t)]

    def rope_ok(dd: int) -> bool:  # every head dim stays even, the rotated part whole, per-frequency lists divide
        if any(x // dd % 2 for x in dims if x % 2 == 0):
            return False
        for r in ropes:
            factor = r.get("partial_rotary_factor", text.get("partial_rotary_factor")) or 1.0
            rotary = int((head_dim or 0) * factor)  # as transformers rounds it
            if head_dim and (rotary % dd or int(head_dim // dd * factor) != rotary // dd or rotary // dd % 2):
                return False
            if any(len(v) % dd if "factor" in k else any(x % dd for x in v) for k, v in r.items()
                   if isinstance(v, list) and ("factor" in k or k.startswith("mrope_section"))):
                return False
        return True

    dd = _divisor(reduce(math.gcd, dims, 0), max(dims), dim_target, rope_ok) if dims else 1
    # a hidden size tied to the heads stays a multiple of _ALIGN by the choice of divisor; a free one (explicit
    # head_dim, heads x head_dim != hidden) is rounded up like the MLP widths
    free = bool(hidden and heads and _is_int(text.get("head_dim")) and heads * text["head_dim"] != hidden)
    aligned = lambda dc: free or not hidden or hidden % (_ALIGN * dc * dd) == 0  # noqa: E731
    dc = _divisor(reduce(math.gcd, primary, 0), heads, heads_target, aligned if aligned(1) else lambda _: True) \
        if primary else 1
    if not dims and hidden:  # no per-head dim (Mamba, RWKV): the widths alone
        g = reduce(math.gcd, widths, 0)
        dd = _divisor(g // dc if g % dc == 0 else 1, hidden // dc, heads_target * dim_target)
    width = dc * dd
    facts["divisors"] = {"heads": dc, "head_dim": dd, "width": width}

    def scale(k: str, v):
        if isinstance(v, list):
            return [scale(k, x) for x in v]
        if not _is_int(v) or v <= 1:
            return v
        if _COUNT.search(k):  # a grouping count (KV heads, SSM groups) still divides the heads it groups
            return v // math.gcd(v, dc) if _GROUPED.search(k) else v // dc
        if _DIM.search(k):
            return max(1, v // dd)
        if _MLP.search(k) or free and v == hidden:
            return -(-v // (width * _ALIGN)) * _ALIGN
        return max(1, -(-v // width))

    old_ids = sorted({x for t in tables for k, v in t.items() if _TOKEN_ID.search(k)
                      for x in (v if isinstance(v, list) else [v]) if _is_int(x) and x >= _VOCAB})
    new_ids = {old: _VOCAB - 1 - i for i, old in enumerate(old_ids)}
    for t in tables:
        for k, v in list(t.items()):
            if _COUNT.search(k) or _DIM.search(k) or _WIDTH.search(k):
                t[k] = scale(k, v)
            elif k in _STATES and _is_int(v):
                t[k] = min(v, _STATE)
            elif _VOCABS.search(k) and _is_int(v) and v > _VOCAB:
                facts[k], t[k] = {"from": v, "to": _VOCAB}, _VOCAB
            elif _TOKEN_ID.search(k):
                t[k] = [new_ids.get(x, x) for x in v] if isinstance(v, list) else new_ids.get(v, v)
        top_k = max([t[k] for k in _TOP_K if _is_int(t.get(k))] or [1])
        groups = max([t[k] for k in ("n_group", "num_expert_group") if _is_int(t.get(k))] or [1])
        for k in _EXPERTS:
            if _is_int(t.get(k)) and t[k] > 0:
                n = min(t[k], -(-max(4, 2 * top_k, 2 * groups) // groups) * groups)
                facts["experts"], t[k] = {"from": t[k], "to": n, "top_k": top_k}, n
        for r in _rope_dicts(t):
            for k, v in r.items():
                if isinstance(v, list) and ("factor" in k or k.startswith("mrope_section")):
                    r[k] = v[::dd] if "factor" in k else [x // dd for x in v]


def _place_thresholds(tables: list[tuple[str, dict]], text_path: str, max_tokens: int | None, facts: dict) -> None:
    def place(name: str, value: int) -> int:
        binds = max_tokens is None or max_tokens > value
        facts[name] = {"value": value, "binds": binds}
        return PROBE_THRESHOLD if binds else _FAR

    for path, t in tables:
        if path != text_path and not path.startswith(text_path + "per_layer_config."):
            continue
        for k in _WINDOWS:
            if _is_int(t.get(k)) and t[k] > 0:
                t[k] = place(path + k, t[k])
        managed = False  # max_position_embeddings placed by the rope
        for r in _rope_dicts(t):
            kind, maximum = str(r.get("rope_type", r.get("type", ""))), t.get("max_position_embeddings")
            if kind == "longrope" and not managed:  # long factors past the original length; max / original scales
                old = t.get("original_max_position_embeddings") or r.get("original_max_position_embeddings") or maximum
                new = place(path + "original_max_position_embeddings", old)
                r["original_max_position_embeddings"] = new
                if "original_max_position_embeddings" in t:
                    t["original_max_position_embeddings"] = new
                t["max_position_embeddings"], managed = round(new * (maximum or old) / old), True
            elif "dynamic" in kind and maximum and not managed:  # the NTK base grows past max_position_embeddings
                t["max_position_embeddings"], managed = place(path + "max_position_embeddings", maximum), True
        for k in _POSITIONS:  # learned position tables hold the probe's sequences
            if _is_int(t.get(k)) and not (managed and k == "max_position_embeddings"):
                t[k] = max(t[k], _FAR)


def _rebuild(config, d: dict):
    """``type(config)`` from ``d``, with the attention / experts implementations of ``config`` and its parts."""
    new = type(config).from_dict(copy.deepcopy(d))
    pairs = [(config, new)] + [(sub, getattr(new, k, None)) for k, sub in vars(config).items()
                               if hasattr(sub, "_attn_implementation_internal")]
    for old, part in pairs:
        for name in ("_attn_implementation_internal", "_experts_implementation_internal"):
            if part is not None and getattr(old, name, None) is not None:
                setattr(part, name, getattr(old, name))
    return new


def _index_list(k: str, v, n: int) -> bool:
    """Layer indices (``mlp_only_layers``, ``hybrid_layer_ids``, ``full_attn_idxs``, ...): increasing, < n."""
    return (isinstance(v, list) and k.endswith(("layers", "ids", "idxs", "indices")) and len(v) > 0
            and all(_is_int(x) and 0 <= x < n for x in v) and all(a < b for a, b in zip(v, v[1:])))


def _per_layer(k: str, v, n: int) -> bool:
    """One value per layer: a list of n values (``layer_types``, ``no_rope_layers``) or an n-character pattern."""
    if isinstance(v, str):
        return len(v) == n and "pattern" in k
    return isinstance(v, list) and len(v) == n and not _TOKEN_ID.search(k) and not _index_list(k, v, n)


def _reduce_layers(config, shrunk, d: dict, model_class, facts: dict):
    """``shrunk`` with fewer layers, or itself. Candidates keep every kind of layer: the prefix up to the first
    layer of each kind, the first layer of each kind alone (kinds marked at the end, like the last layer of a
    type), and both with two layers of each kind (families tying weights across a kind). The first candidate whose
    layers all stay as they were wins; short prefixes go first, since a selection renumbers layers and a forward
    reading its layer index could compute differently where no attribute shows it."""
    table = _text_dict(config, d)
    keys = [k for k in _LAYERS if _is_int(table.get(k))]
    kinds = next((v for k, v in table.items() if k in ("layer_types", "layers_block_type") and isinstance(v, list)), [])
    if not keys and not kinds:  # (Nemotron-H counts its layers from layers_block_type)
        return shrunk
    n = table[keys[0]] if keys else len(kinds)
    facts["layers"] = {"from": n, "to": n}
    lists = [k for k, v in table.items() if _per_layer(k, v, n)]
    indices = [k for k, v in table.items() if _index_list(k, v, n)]
    full = _layer_rows(shrunk, table, n, model_class, lists, indices) if n > 2 else None
    if full is None:  # two layers, or layers that cannot be told apart: all kept
        return shrunk
    seen: dict[str, list[int]] = {}
    for i, row in enumerate(full):
        seen.setdefault(row, []).append(i)
    facts["layers"]["kinds"] = len(seen)
    selections = set()
    for times in (1, 2):
        chosen = sorted({i for at in seen.values() for i in at[:times]} | {0, 1})
        selections |= {tuple(range(chosen[-1] + 1)), tuple(chosen)}
    for keep in sorted((s for s in selections if len(s) < n), key=lambda s: (s[-1] >= len(s) or len(s) > 8, len(s))):
        short_d = copy.deepcopy(d)
        short = _text_dict(config, short_d)
        for k in lists:
            short[k] = [table[k][i] for i in keep]
            short[k] = "".join(short[k]) if isinstance(table[k], str) else short[k]
        for k in indices:
            short[k] = [keep.index(i) for i in table[k] if i in keep]
        if short.get("per_layer_config"):
            overrides = {int(i): o for i, o in short["per_layer_config"].items()}
            short["per_layer_config"] = {str(j): overrides[i] for j, i in enumerate(keep) if i in overrides}
        if isinstance(short.get("attention_types"), list) and "attention_layers" in short:  # GPT-Neo's pattern
            short["attention_types"] = [[[kind], 1] for kind in short["attention_layers"]]
        short.update({k: len(keep) for k in keys if table[k] == n})
        try:
            smaller = _rebuild(config, short_d)
            if _layer_rows(smaller, short, len(keep), model_class, lists, indices) == [full[i] for i in keep]:
                facts["layers"].update(to=len(keep), kept=None if keep[-1] < len(keep) else list(keep))
                return smaller
        except Exception:  # the family does not take this selection
            pass
    return shrunk


# config properties that are deprecated aliases of other fields (transformers warns when they are read)
DEPRECATED_ALIASES = ("torch_dtype", "use_return_dict")


def _layer_rows(config, table: dict, n: int, model_class, lists: list[str], indices: list[str]) -> list[str] | None:
    """One string per layer, equal for layers of one kind: per-layer config values (``lists``, ``indices``,
    per-layer overrides, list-valued properties) and the structure of its modules (None: not buildable here)."""
    model = _structure(model_class, config) if model_class is not None else None
    lists_n = [(name, m) for name, m in (model.named_modules() if model else [])  # (vision towers: shrink_vision)
               if isinstance(m, torch.nn.ModuleList) and len(m) == n and not re.search("vision|visual", name)]
    layers = [m for name, m in lists_n if not any(name.startswith(other + ".") for other, _ in lists_n)]
    if not layers:
        return None
    rows = [[(k, repr(table[k][i])) for k in lists] + [(k, i in table[k]) for k in indices] for i in range(n)]
    for i, override in (table.get("per_layer_config") or {}).items():
        rows[int(i)].append(("override", repr(sorted(override.items()))))
    text = config.get_text_config(decoder=True)
    for name in sorted({k for c in type(text).__mro__ for k, v in vars(c).items() if isinstance(v, property)}):
        if name in DEPRECATED_ALIASES:  # reading them logs a deprecation warning; never per-layer values
            continue
        try:
            value = getattr(text, name) if name not in ("per_layer_config", "rope_scaling") else None
        except Exception:
            continue
        if isinstance(value, (list, tuple)) and len(value) == n and name not in table:
            for i in range(n):
                rows[i].append((name, repr(value[i])))
    return [repr(row + [_signature(m[i]) for m in layers]) for i, row in enumerate(rows)]


def _signature(layer: torch.nn.Module) -> tuple:
    """Every module's name, class, plain attributes (not its layer index) and parameter / buffer shapes."""
    return tuple((name, type(m).__name__,
                  tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "training"
                               and not _INDEX_ATTR.search(k) and isinstance(v, (bool, int, float, str, type(None))))),
                  tuple((k, tuple(p.shape)) for k, p in [*m._parameters.items(), *m._buffers.items()] if p is not None))
                 for name, m in layer.named_modules())
