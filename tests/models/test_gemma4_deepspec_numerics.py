"""Our exported Gemma4 drafters, read with the semantics of DeepSpec's torch modules
(`Gemma4DSparkModel` / `Gemma4Eagle3Model`, deepspec/modeling/{dspark,eagle3}/gemma4/modeling.py),
give our logits: an independent float64 re-implementation written from those modules, fed the
exported state dict and config.json only.

What it pins down: the draft layer (global head dim; k=v attention where values are the raw
k_proj output under the scale-free v norm, or a v_proj; q/k norms; attention scale 1; the
full-attention proportional RoPE with its partial rotary factor; sandwich norms; GELU-tanh MLP;
`layer_scalar`), the √D token-embedding scale, hidden_norm(fc(·)) context injection, the
softcapped head with the Markov bias added after the cap, the confidence head, and the Eagle3
fused layer ([input_layernorm(embed) ; hidden_norm(h)] with h as residual) — and every tensor
name and layout of the export."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

from dspark_jax.models import init_draft, load_target
from dspark_jax.models.io.hf import read_safetensors_dir
from hf_tiny import save_tiny_gemma4

# targets without per-layer inputs / KV sharing (DeepSpec's Gemma4 drafters refuse those)
NO_PLE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
TARGETS = {
    # k=v full attention (1 global K/V head, head dim 16 vs 8), ¼-rotated proportional RoPE,
    # softcap 3, tied head
    "kv_shared": ("all_features", dict(NO_PLE, num_hidden_layers=4,
                                       layer_types=["sliding_attention", "full_attention"] * 2)),
    # a v_proj (2 K/V heads), ½-rotated RoPE, no softcap, untied head
    "v_proj": ("untied_plain", NO_PLE),
}
BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1, 2), mask_token_id=4)
DRAFTS = {
    "dspark": dict(BASE, markov_rank=8),
    "gated": dict(BASE, markov_rank=8, markov_head_type="gated"),
    "rnn": dict(BASE, markov_rank=8, markov_head_type="rnn", confidence_head_with_markov=False),
    "dflash": dict(BASE, model_type="dflash", markov_rank=0, enable_confidence_head=False),
    "eagle3": dict(block_size=4, target_layer_ids=(0, 1, 2), mask_token_id=4,
                   model_type="eagle3", draft_num_hidden_layers=2, ttt_length=3),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {k: load_target(save_tiny_gemma4(tmp_path_factory.mktemp(k), v, seed=5, **kw))
            for k, (v, kw) in TARGETS.items()}


def _exported(target, kind, tmp_path, seed=1):
    """A random draft with non-trivial norms / layer scalars (and a Markov bias that matters),
    saved in DeepSpec's layout → (draft, config.json, float64 torch tensors)."""
    draft = init_draft(target, DRAFTS[kind], seed=seed)
    graphdef, state = nnx.split(draft.model)
    rng = np.random.RandomState(seed)

    def perturb(path, x):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        x = np.asarray(x)
        if "norm" in name or "scalar" in name:
            return x * (1.0 + 0.2 * rng.randn(*x.shape)).astype(x.dtype)
        if "markov" in name and "w2" in name:
            return x * 40.0
        return x

    pure = jax.tree_util.tree_map_with_path(perturb, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    draft = type(draft).from_model(nnx.merge(graphdef, state))
    draft.save(tmp_path / "ck")
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    tensors = {k: torch.as_tensor(np.asarray(v, np.float64))
               for k, v in read_safetensors_dir(tmp_path / "ck").items()}
    return draft, raw, tensors


# ----------------------------------------------------------------- DeepSpec semantics, float64
class _Ref:
    """Gemma4 draft-layer pieces as DeepSpec's modules compute them (Gemma4RMSNorm,
    Gemma4TextMLP, the full-attention Gemma4TextRotaryEmbedding, Gemma4*Attention)."""

    def __init__(self, cfg: dict, t: dict):
        self.c, self.t, self.eps = cfg, t, cfg["rms_norm_eps"]
        self.N = cfg["num_attention_heads"]
        self.H = cfg["global_head_dim"]
        self.k_eq_v = cfg["attention_k_eq_v"]
        self.K = cfg["num_global_key_value_heads"] if self.k_eq_v else cfg["num_key_value_heads"]

    def rms(self, x, w=None):
        y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return y if w is None else y * w

    def rope(self, x, pos):                   # x [n, heads, H]; rotate-half, proportional
        rp, H = self.c["rope_parameters"]["full_attention"], self.H
        n_rot = int(rp.get("partial_rotary_factor", 1.0) * H // 2)
        inv = torch.zeros(H // 2, dtype=torch.float64)
        inv[:n_rot] = rp["rope_theta"] ** -(torch.arange(0, 2 * n_rot, 2, dtype=torch.float64) / H)
        inv = inv / rp.get("factor", 1.0)
        ang = torch.as_tensor(np.asarray(pos), dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., H // 2:], x[..., :H // 2]], -1) * sin

    def qkv(self, i, xq, xkv, qpos, kpos):
        p = lambda n: self.t[f"layers.{i}.{n}"]
        q = self.rms(F.linear(xq, p("self_attn.q_proj.weight")).view(-1, self.N, self.H),
                     p("self_attn.q_norm.weight"))
        k_raw = F.linear(xkv, p("self_attn.k_proj.weight")).view(-1, self.K, self.H)
        v_raw = k_raw if self.k_eq_v else F.linear(
            xkv, p("self_attn.v_proj.weight")).view(-1, self.K, self.H)
        k = self.rms(k_raw, p("self_attn.k_norm.weight"))
        v = self.rms(v_raw)                    # v_norm: with_scale=False
        return self.rope(q, qpos), self.rope(k, kpos), v

    def attend(self, i, q, k, v, visible):     # visible [q, k]; scale 1
        g = self.N // self.K
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("qnh,knh->nqk", q, k).masked_fill(~visible[None], float("-inf"))
        o = torch.einsum("nqk,knh->qnh", torch.softmax(s, -1), v).reshape(q.shape[0], -1)
        return F.linear(o, self.t[f"layers.{i}.self_attn.o_proj.weight"])

    def tail(self, i, residual, attn):
        p = lambda n: self.t[f"layers.{i}.{n}.weight"]
        h = residual + self.rms(attn, p("post_attention_layernorm"))
        x = self.rms(h, p("pre_feedforward_layernorm"))
        m = F.linear(F.gelu(F.linear(x, p("mlp.gate_proj")), approximate="tanh")
                     * F.linear(x, p("mlp.up_proj")), p("mlp.down_proj"))
        h = h + self.rms(m, p("post_feedforward_layernorm"))
        return h * self.t[f"layers.{i}.layer_scalar"]

    def embed(self, toks):
        return F.embedding(torch.as_tensor(toks), self.t["embed_tokens.weight"]) * (
            float(self.c["hidden_size"]) ** 0.5)

    def head(self, h):                          # compute_logits: lm_head, then the softcap
        logits = F.linear(h, self.t["lm_head.weight"])
        cap = self.c.get("final_logit_softcapping")
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _markov_bias(cfg, t, h, prev_emb):
    """VanillaMarkov / GatedMarkovHead / RNNHead (teacher-forced) bias [γ, V] of a block."""
    m = lambda n: t[f"markov_head.{n}"]
    w2 = lambda z: F.linear(z, m("markov_w2.weight"))
    kind = cfg.get("markov_head_type", "vanilla")
    if kind == "vanilla":
        return w2(prev_emb)
    if kind == "gated":
        gate = torch.sigmoid(F.linear(torch.cat([h, prev_emb], -1), m("gate_proj.weight"),
                                      m("gate_proj.bias")))
        return w2(gate * prev_emb)
    assert kind == "rnn"
    state, out = torch.zeros(cfg["markov_rank"], dtype=torch.float64), []
    for k in range(h.shape[0]):                 # GRU-like state over the block
        z = F.linear(torch.cat([state, prev_emb[k], h[k]]), m("joint_proj.weight"),
                     m("joint_proj.bias"))
        g, c, o = z.chunk(3)
        g = torch.sigmoid(g)
        state = g * state + (1.0 - g) * torch.tanh(c)
        out.append(w2(torch.tanh(o)))
    return torch.stack(out)


def _deepspec_block(cfg, t, feats, anchor_tok, a, prev):
    """Gemma4DSparkModel on one block [x0, M…M] at positions a..a+γ−1 over context < a."""
    r, g = _Ref(cfg, t), cfg["block_size"]
    ctx = r.rms(F.linear(torch.as_tensor(feats[:a]), t["fc.weight"]), t["hidden_norm.weight"])
    h = r.embed([anchor_tok] + [cfg["mask_token_id"]] * (g - 1))
    bpos = np.arange(a, a + g)
    visible = torch.ones(g, a + g, dtype=torch.bool)
    for i in range(cfg["num_hidden_layers"]):
        x = r.rms(h, t[f"layers.{i}.input_layernorm.weight"])
        q, k, v = r.qkv(i, x, torch.cat([ctx, x]), bpos, np.concatenate([np.arange(a), bpos]))
        h = r.tail(i, h, r.attend(i, q, k, v, visible))
    h = r.rms(h, t["norm.weight"])
    base = r.head(h)
    out = {"base_logits": base, "logits": base, "confidence_logits": None}
    if cfg["markov_rank"]:                     # the Markov bias, added after the softcap
        prev_emb = F.embedding(torch.as_tensor(prev), t["markov_head.markov_w1.weight"])
        out["logits"] = base + _markov_bias(cfg, t, h, prev_emb)
        if cfg["enable_confidence_head"]:
            feats = torch.cat([h, prev_emb], -1) if cfg["confidence_head_with_markov"] else h
            out["confidence_logits"] = F.linear(feats, t["confidence_head.proj.weight"],
                                                t["confidence_head.proj.bias"])[:, 0]
    return {k: None if v is None else v.numpy() for k, v in out.items()}


def _deepspec_eagle3(cfg, t, feats, next_tokens):
    """Gemma4Eagle3Model.forward(hidden_states=feats, input_ids=next_tokens, causal mask,
    positions 0..S−1) then compute_logits."""
    r, S = _Ref(cfg, t), feats.shape[0]
    h = F.linear(torch.as_tensor(feats), t["fc.weight"])
    emb = r.embed(next_tokens)
    pos = np.arange(S)
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    for i in range(cfg["num_hidden_layers"]):
        x = torch.cat([r.rms(emb, t[f"layers.{i}.input_layernorm.weight"]),
                       r.rms(h, t[f"layers.{i}.hidden_norm.weight"])], -1)
        q, k, v = r.qkv(i, x, x, pos, pos)
        h = r.tail(i, h, r.attend(i, q, k, v, causal))
    return r.head(r.rms(h, t["norm.weight"])).numpy()


# ----------------------------------------------------------------------------------- tests
def _feats(draft, S, seed=0):
    n = draft.config.num_features * draft.config.target.hidden_size
    return np.random.RandomState(seed).randn(S, n).astype(np.float32)


@pytest.mark.parametrize("target_name,kind", [
    ("kv_shared", "dspark"), ("v_proj", "dflash"),
    pytest.param("kv_shared", "gated", marks=pytest.mark.slow),
    pytest.param("v_proj", "rnn", marks=pytest.mark.slow)])
def test_gemma4_block_logits_equal_deepspec_semantics(targets, target_name, kind, tmp_path):
    draft, cfg, t = _exported(targets[target_name], kind, tmp_path)
    assert cfg["architectures"] == ["Gemma4DSparkModel"]
    feats, a, prev = _feats(draft, 12), 7, [11, 12, 13, 14]
    ours = draft.block_logits(feats, 11, a, prev)
    ref = _deepspec_block(cfg, t, feats.astype(np.float64), 11, a, prev)
    for key in ("base_logits", "logits", "confidence_logits"):
        if ref[key] is None:
            assert ours[key] is None
            continue
        assert np.abs(ours[key] - ref[key]).max() <= 1e-4, key
    if kind != "dflash":
        assert np.abs(ours["logits"] - ours["base_logits"]).max() > 1e-2   # the bias matters


@pytest.mark.parametrize("target_name", [
    "kv_shared", pytest.param("v_proj", marks=pytest.mark.slow)])
def test_gemma4_eagle3_logits_equal_deepspec_semantics(targets, target_name, tmp_path):
    draft, cfg, t = _exported(targets[target_name], "eagle3", tmp_path)
    assert cfg["architectures"] == ["Gemma4Eagle3Model"] and cfg["num_hidden_layers"] == 2
    S = 9
    feats = _feats(draft, S, seed=1)
    ids = np.random.RandomState(2).randint(5, 90, S).astype(np.int32)
    m = draft.model
    h = m.ttt_hidden(feats[None], ids[None], ttt_length=1)[0, 0]       # step 0, [S, D]
    ours = np.asarray(m.logits(h), np.float64)
    # step 0 at position t reads embed(x_{t+1}) (token 0 past the end)
    ref = _deepspec_eagle3(cfg, t, feats.astype(np.float64), np.append(ids[1:], 0))
    assert np.abs(ours - ref).max() <= 1e-4
