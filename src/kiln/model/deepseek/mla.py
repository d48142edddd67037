"""Multi-head latent attention (DeepSeek-V2/V3), with YaRN's rotary rescaling.

Keys and values come from one compressed latent per token (kv_lora_rank wide, RMS-normed),
projected up per head; a narrow rotary key (qk_rope_head_dim) is shared by every head. Each
query head is a no-rope part (qk_nope_head_dim) and a rope part; the softmax scale is
1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale^2 when configured.

Training and prefill expand the latent into per-head keys and values and run kiln's attention
(`kiln.model.attention`; values are narrower than keys). Decoding caches only the latent and
the rotary key, and attends in the latent space: the key up-projection is absorbed into the
queries and the value up-projection applied after (DeepSeek-V2's inference form), so no
per-head key or value is ever formed for the cached tokens.

Einsum letters as in `kiln.model.llama`, plus R kv_lora_rank, Q q_lora_rank, P
qk_rope_head_dim, C = R + P, A qk_nope_head_dim, V v_head_dim, H = A + P.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kiln.config import ModelConfig
from kiln.model.attention import attention, cached_attention, causal_attention
from kiln.model.interface import DTYPES
from kiln.model.llama import RMSNorm
from kiln.model.llama.layers import HEADS, KV_HEADS, param
from kiln.model.project import project
from kiln.parallel.mesh import constrain

# The latent projections' RMSNorms use DeepSeek's fixed epsilon (its reference code and
# Hugging Face's leave them at the default), whatever model.norm_eps is.
LATENT_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_settings(yarn) -> tuple[float, ...] | None:
    """model.deepseek.yarn as the tuple `rope_frequencies` reads (None: no rescaling)."""
    if yarn is None:
        return None
    return (
        yarn.factor,
        yarn.original_max_position_embeddings,
        yarn.beta_fast,
        yarn.beta_slow,
        yarn.mscale,
        yarn.mscale_all_dim,
    )


def rope_frequencies(
    dim: int, theta: float, yarn: tuple[float, ...] | None, truncate: bool = True
) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2] float32, the factor on cos and sin) of the rotary part.

    With `yarn` (`yarn_settings`: factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim), YaRN as Hugging Face computes it:
    the frequencies that turn fewer than beta_slow times over the original context are
    divided by factor, those that turn more than beta_fast times are kept, a linear ramp
    between (its ends rounded outwards when `truncate`, as DeepSeek-V3's; GPT-OSS's are not);
    cos and sin are scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor, 1) when either
    is 0.
    """
    pos = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if yarn is None:
        return (1.0 / pos).astype(np.float32), 1.0
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = yarn

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.astype(np.float32)
    freq = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    return freq.astype(np.float32), float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)^2
    with YaRN (when mscale_all_dim is set)."""
    ds = cfg.deepseek
    scale = (ds.qk_nope_head_dim + ds.qk_rope_head_dim) ** -0.5
    if ds.yarn is not None and ds.yarn.mscale_all_dim:
        scale *= yarn_mscale(ds.yarn.factor, ds.yarn.mscale_all_dim) ** 2
    return scale


def rotate(x_BSNP, positions_BS, settings):
    """Rotary embedding in the rotate-half layout (pairs i and i + P/2) at `settings` (width,
    theta, yarn and optionally truncate, as `rope_frequencies` reads them; cos and sin times
    YaRN's factor); float32 inside. (DeepSeek's checkpoints pair columns 2i and 2i+1: the Hugging
    Face format permutes those columns of the projections on import and back on export.)"""
    freq_h, factor = rope_frequencies(*settings)
    angle_BSh = positions_BS[..., None].astype(jnp.float32) * jnp.asarray(freq_h)
    sin = (factor * jnp.sin(angle_BSh))[:, :, None, :]
    cos = (factor * jnp.cos(angle_BSh))[:, :, None, :]
    x1, x2 = jnp.split(x_BSNP.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNP.dtype)


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention that stays inside each packed document.

    Parameters: the queries' `wq` [D,N,H], or `wq_a` [D,Q], `q_norm` and `wq_b` [Q,N,H] with
    model.deepseek.q_lora_rank; `wkv_a` [D,C] (the latent, then the rotary key), `kv_norm`,
    `wkv_b` [R,N,A+V] (each head's no-rope key, then its value) and `wo` [N,V,D]. In every
    query and key the no-rope part comes first.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        ds = cfg.deepseek
        d, n = cfg.d_model, cfg.num_heads
        a, p, v, r = ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim, ds.kv_lora_rank
        heads, into = ("embed", "heads", "head_dim"), ("embed",)
        latent_cfg = cfg.model_copy(update={"norm_eps": LATENT_EPS})
        if ds.q_lora_rank is None:
            self.wq = param(rngs, cfg, (d, n, a + p), heads, "matrix", into)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            q = ds.q_lora_rank
            self.wq_a = param(rngs, cfg, (d, q), ("embed", None), "matrix", into)
            self.q_norm = RMSNorm(q, "norm", latent_cfg)
            # The latent axis is the fan-in: split like embed (fsdp), as the other projections'.
            self.wq_b = param(rngs, cfg, (q, n, a + p), heads, "matrix", into)
        self.wkv_a = param(rngs, cfg, (d, r + p), ("embed", None), "matrix", into)
        self.kv_norm = RMSNorm(r, "norm", latent_cfg)
        self.wkv_b = param(rngs, cfg, (r, n, a + v), heads, "matrix", into)
        out_of = ("heads", "head_dim")
        self.wo = param(rngs, cfg, (n, v, d), ("heads", "head_dim", "embed"), "matrix", out_of)
        self.nope, self.rank = a, r
        # Static settings; the frequencies are recomputed (in numpy) when traced.
        self.rope_settings = (p, cfg.rope_theta, yarn_settings(ds.yarn))
        self.scale = softmax_scale(cfg)
        self.dtype = DTYPES[cfg.dtype]
        self.implementation = cfg.attention
        self.context = cfg.context_parallel

    def _queries(self, x_BSD, positions_BS):
        """(no-rope queries [B,S,N,A], rotated queries [B,S,N,P])."""
        dt = self.dtype
        if self.wq is None:
            c_BSQ = project("BSD,DQ->BSQ", x_BSD, self.wq_a[...].astype(dt))
            q_BSNH = project("BSQ,QNH->BSNH", self.q_norm(c_BSQ), self.wq_b[...].astype(dt))
        else:
            q_BSNH = project("BSD,DNH->BSNH", x_BSD, self.wq[...].astype(dt))
        q_BSNH = checkpoint_name(q_BSNH, "q_proj")
        q_BSNA, q_BSNP = q_BSNH[..., : self.nope], q_BSNH[..., self.nope :]
        return q_BSNA, rotate(q_BSNP, positions_BS, self.rope_settings)

    def _latent(self, x_BSD, positions_BS):
        """(the normed latent [B,S,1,R], the rotated shared key [B,S,1,P]): what is cached."""
        kv_BSC = project("BSD,DC->BSC", x_BSD, self.wkv_a[...].astype(self.dtype))
        kv_BSC = checkpoint_name(kv_BSC, "k_proj")
        c_BSR, k_BSP = kv_BSC[..., : self.rank], kv_BSC[..., self.rank :]
        k_BS1P = rotate(k_BSP[:, :, None, :], positions_BS, self.rope_settings)
        return self.kv_norm(c_BSR)[:, :, None, :], k_BS1P

    def _expanded(self, x_BSD, positions_BS):
        """Queries [B,S,N,H] (times the scale beyond 1/sqrt(H)), keys [B,S,N,H] and values
        [B,S,N,V] of every head, and the cache entries (`_latent`)."""
        q_BSNA, q_BSNP = self._queries(x_BSD, positions_BS)
        c_BS1R, k_BS1P = self._latent(x_BSD, positions_BS)
        kv_BSNK = project("BSR,RNK->BSNK", c_BS1R[:, :, 0], self.wkv_b[...].astype(self.dtype))
        kv_BSNK = checkpoint_name(kv_BSNK, "v_proj")
        k_BSNA, v_BSNV = kv_BSNK[..., : self.nope], kv_BSNK[..., self.nope :]
        b, s, n, _ = k_BSNA.shape
        k_BSNP = jnp.broadcast_to(k_BS1P, (b, s, n, k_BS1P.shape[-1]))
        h = q_BSNA.shape[-1] + q_BSNP.shape[-1]
        q_BSNH = jnp.concatenate([q_BSNA, q_BSNP], axis=-1)
        q_BSNH = (q_BSNH * (self.scale * h**0.5)).astype(q_BSNA.dtype)
        k_BSNH = jnp.concatenate([k_BSNA, k_BSNP], axis=-1)
        q_BSNH, k_BSNH = constrain(q_BSNH, HEADS), constrain(k_BSNH, KV_HEADS)
        return q_BSNH, k_BSNH, constrain(v_BSNV, KV_HEADS), (c_BS1R, k_BS1P)

    def _out(self, out_BSNV):
        out_BSNV = checkpoint_name(constrain(out_BSNV, HEADS), "attn_out")
        out_BSD = project("BSNV,NVD->BSD", out_BSNV, self.wo[...].astype(self.dtype))
        return checkpoint_name(out_BSD, "out_proj")

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, local=False):
        """`local` is always False: latent attention has no sliding window (config refuses it)."""
        q_BSNH, k_BSNH, v_BSNV, _ = self._expanded(x_BSD, positions_BS)
        out_BSNV = attention(
            q_BSNH,
            k_BSNH,
            v_BSNV,
            segment_ids_BS,
            implementation=self.implementation,
            context=self.context,
        )
        return self._out(out_BSNV)

    def cached(self, x_BSD, positions_BS, segment_ids_BS, layer, local=False):
        """(output, new latents [B,S,1,R], new rotary keys [B,S,1,P]) of S new tokens.

        `layer` is (latents [B,T,1,R], rotary keys [B,T,1,P], segment_ids_BT, index), or None
        for an empty cache (a prefill: the tokens attend to each other through the expanded
        keys and values, as in training). Over a cache the queries attend in the latent space:
        q_nope W_UK against the latents, the rotary parts against the rotary keys, and the
        weighted latents through W_UV.
        """
        if layer is None:
            q_BSNH, k_BSNH, v_BSNV, (c_BS1R, k_BS1P) = self._expanded(x_BSD, positions_BS)
            return (
                self._out(causal_attention(q_BSNH, k_BSNH, v_BSNV, segment_ids_BS)),
                c_BS1R,
                k_BS1P,
            )
        c_BT1R, k_BT1P, segment_ids_BT, index = layer
        q_BSNA, q_BSNP = self._queries(x_BSD, positions_BS)
        c_BS1R, k_BS1P = self._latent(x_BSD, positions_BS)
        at = (0, index, 0, 0)
        c_BT1R = jax.lax.dynamic_update_slice(c_BT1R, c_BS1R.astype(c_BT1R.dtype), at)
        k_BT1P = jax.lax.dynamic_update_slice(k_BT1P, k_BS1P.astype(k_BT1P.dtype), at)
        wkv_b = self.wkv_b[...].astype(self.dtype)
        w_uk_RNA, w_uv_RNV = wkv_b[..., : self.nope], wkv_b[..., self.nope :]
        q_BSNR = jnp.einsum("BSNA,RNA->BSNR", q_BSNA, w_uk_RNA)
        q_BSNC = jnp.concatenate([q_BSNR, q_BSNP.astype(q_BSNR.dtype)], axis=-1)
        # cached_attention divides by sqrt(C): scaled to the latent attention's own scale.
        c = q_BSNC.shape[-1]
        q_BSNC = (q_BSNC * (self.scale * c**0.5)).astype(q_BSNR.dtype)
        keys_BT1C = jnp.concatenate([c_BT1R, k_BT1P], axis=-1)
        out_BSNR = cached_attention(
            q_BSNC, keys_BT1C, c_BT1R, segment_ids_BS, segment_ids_BT, index
        )
        out_BSNV = jnp.einsum("BSNR,RNV->BSNV", out_BSNR, w_uv_RNV)
        return self._out(out_BSNV), c_BS1R, k_BS1P


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one latent attention layer's projections (norm scales excluded)."""
    ds = cfg.deepseek
    d, n = cfg.d_model, cfg.num_heads
    a, p, v, r = ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim, ds.kv_lora_rank
    q = d * n * (a + p) if ds.q_lora_rank is None else ds.q_lora_rank * (d + n * (a + p))
    return q + d * (r + p) + r * n * (a + v) + n * v * d
