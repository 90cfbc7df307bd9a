"""Head files: the published EAGLE (EAGLE-1 / EAGLE-2) and EAGLE-3 checkpoint layouts, which are also
the layout :func:`save_head` writes.

A head folder holds ``config.json`` (Llama-style fields: ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``;
EAGLE-3 adds ``draft_vocab_size`` and optionally ``target_hidden_size``) and the weights as
``model.safetensors`` or ``pytorch_model.bin``. State-dict keys:

* EAGLE: ``fc.weight`` [H, 2H], ``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
  (no input norm), optionally ``embed_tokens.weight``; logits through the target's LM head.
* EAGLE-3: ``fc.weight`` [H, 3 * target H] (no bias), ``midlayer.self_attn.{q,k,v}_proj.weight``
  [*, 2H], ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``midlayer.hidden_norm.weight``,
  ``midlayer.input_layernorm.weight``, ``midlayer.post_attention_layernorm.weight``, ``norm.weight``,
  ``lm_head.weight`` [draft vocab, H], ``d2t`` [draft vocab] int64 (target id = draft id + d2t),
  ``t2d`` [vocab] bool, optionally ``embed_tokens.weight``. Its target features are the residual
  streams entering layers 2, L // 2 and L - 3 of an L-layer target (EAGLE-3's choice), unless the
  config says otherwise (``specdec.feature_layers``).

specdec's own heads add a ``specdec`` block to config.json (style, feature layers, draft vocabulary)
and may carry ``lm_head.weight`` / ``d2t`` in the EAGLE layout too (a reduced-vocabulary head).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from specdec.drafters.eagle.net import HeadConfig, HeadNet

__all__ = ["save_head", "load_head", "eagle3_layers"]

_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")


def eagle3_layers(num_layers: int) -> tuple:
    """EAGLE-3's low / mid / high feature layers of an L-layer target (inputs of layers 2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def _key_map(style: str) -> Dict[str, str]:
    """Checkpoint key -> HeadNet state-dict key."""
    pre = "midlayer." if style == "eagle3" else "layers.0."
    m = {f"{pre}{name}.weight": f"{name.split('.')[1]}.weight" for name in _LAYER}
    m[f"{pre}post_attention_layernorm.weight"] = "post_attention_layernorm"
    m["fc.weight"] = "fc.weight"
    if style == "eagle3":
        m.update({f"{pre}hidden_norm.weight": "hidden_norm", f"{pre}input_layernorm.weight": "input_layernorm",
                  "norm.weight": "norm"})
    else:
        m["fc.bias"] = "fc.bias"
    m["lm_head.weight"] = "lm_head.weight"
    m["d2t"] = "d2t"
    m["embed_tokens.weight"] = "embed.weight"
    return m


def _read_weights(folder: str) -> Dict[str, torch.Tensor]:
    st = os.path.join(folder, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"load_head: {folder} holds neither model.safetensors nor pytorch_model.bin")


def load_head(path: str, dtype: torch.dtype = torch.float32) -> HeadNet:
    """A :class:`HeadNet` from a head folder (EAGLE / EAGLE-3 layout, or one :func:`save_head` wrote)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"load_head: no config.json in {path!r} (expected an EAGLE / EAGLE-3 head folder)")
    with open(cfg_file) as f:
        conf = json.load(f)
    sd = _read_weights(path)
    style = "eagle3" if any(k.startswith("midlayer.") for k in sd) else "eagle"
    if style == "eagle" and not any(k.startswith("layers.0.") for k in sd):
        raise ValueError(f"load_head: {path!r} has neither EAGLE (layers.0.*) nor EAGLE-3 (midlayer.*) keys")
    own = conf.get("specdec", {})
    H = int(conf["hidden_size"])
    draft_vocab = int(sd["lm_head.weight"].shape[0]) if "lm_head.weight" in sd else 0
    target_h = int(conf.get("target_hidden_size") or H)
    layers = own.get("feature_layers")
    if layers is None:
        layers = () if style == "eagle3" else (-1,)   # () : EAGLE-3's default, resolved against the target
    hc = HeadConfig(hidden_size=H, num_heads=int(conf["num_attention_heads"]),
                    num_kv_heads=int(conf.get("num_key_value_heads") or conf["num_attention_heads"]),
                    intermediate_size=int(conf["intermediate_size"]), vocab_size=int(conf["vocab_size"]),
                    feature_size=3 * target_h if style == "eagle3" else H, style=style, draft_vocab=draft_vocab,
                    rms_eps=float(conf.get("rms_norm_eps", 1e-6)), rope_theta=float(conf.get("rope_theta", 10000.0)),
                    head_dim=int(conf.get("head_dim") or 0), feature_layers=tuple(layers))
    net = HeadNet(hc)
    if "embed_tokens.weight" in sd:
        net.embed = torch.nn.Embedding(*sd["embed_tokens.weight"].shape)
    keys = _key_map(style)
    mapped, unknown = {}, []
    for k, v in sd.items():
        if k == "t2d":
            continue
        if k not in keys:
            unknown.append(k)
            continue
        mapped[keys[k]] = v
    if unknown:
        raise ValueError(f"load_head: {path!r}: unexpected keys {sorted(unknown)[:8]} for the {style} layout")
    expected = net.state_dict()
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise ValueError(f"load_head: {path!r}: missing weights {missing[:8]} for the {style} layout")
    for k, v in mapped.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"load_head: {path!r}: {k} has shape {tuple(v.shape)}, the config implies "
                             f"{tuple(expected[k].shape)}")
    net.load_state_dict({k: (v if k == "d2t" else v.to(dtype)) for k, v in mapped.items()})
    if draft_vocab:
        _check_maps(net, sd.get("t2d"), path)
    return net.to(dtype).eval()


def _check_maps(net: HeadNet, t2d: Optional[torch.Tensor], path: str) -> None:
    ids = net.draft_to_target()
    V = net.cfg.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= V or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"load_head: {path!r}: d2t maps draft ids outside [0, {V}) or twice to one target id")
    if t2d is not None:
        want = torch.zeros(V, dtype=torch.bool)
        want[ids] = True
        if t2d.shape != (V,) or not torch.equal(t2d.to(torch.bool), want):
            raise ValueError(f"load_head: {path!r}: t2d does not mark exactly the target ids d2t maps to")


def save_head(net: HeadNet, path: str, meta: Optional[dict] = None, dtype: torch.dtype = torch.float16) -> None:
    """Write ``net`` as a head folder in the EAGLE / EAGLE-3 layout (weights in ``dtype``, safetensors)."""
    from safetensors.torch import save_file

    hc = net.cfg
    os.makedirs(path, exist_ok=True)
    inv = {v: k for k, v in _key_map(hc.style).items()}
    sd = {}
    for k, v in net.state_dict().items():
        sd[inv[k]] = v.detach().cpu().contiguous() if k == "d2t" else v.detach().cpu().to(dtype).contiguous()
    if hc.style == "eagle3" and "lm_head.weight" in sd:
        t2d = torch.zeros(hc.vocab_size, dtype=torch.bool)
        t2d[net.draft_to_target().cpu()] = True
        sd["t2d"] = t2d
    save_file(sd, os.path.join(path, "model.safetensors"))
    conf = dict(architectures=["LlamaForCausalLM"], hidden_size=hc.hidden_size, num_attention_heads=hc.num_heads,
                num_key_value_heads=hc.num_kv_heads, intermediate_size=hc.intermediate_size, num_hidden_layers=1,
                rms_norm_eps=hc.rms_eps, rope_theta=hc.rope_theta, vocab_size=hc.vocab_size, head_dim=hc.head_dim,
                hidden_act="silu", torch_dtype=str(dtype).replace("torch.", ""),
                specdec=dict(style=hc.style, feature_layers=list(hc.feature_layers), draft_vocab=hc.draft_vocab,
                             **(meta or {})))
    if hc.style == "eagle3":
        conf["draft_vocab_size"] = hc.draft_vocab or hc.vocab_size
        conf["target_hidden_size"] = hc.feature_size // 3
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
