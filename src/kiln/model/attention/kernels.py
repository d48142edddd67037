"""The vendors' fused attention kernels behind kiln's signature: cuDNN's (`model.attention:
cudnn`, NVIDIA GPUs) and Pallas splash attention (`splash`, TPU), and the check that refuses one
the platform or the dtype cannot run.

The contract and the einsum letters: `kiln.model.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kiln.errors import KilnError
from kiln.model.attention.xla import KV_WHOLE, balanced_order, rows_balanced, sequence_shards
from kiln.parallel.mesh import constrain, current_rules, logical_spec, mesh_axes, traced_platform

# Query and key rows per splash-attention kernel block (capped at the sequence length).
SPLASH_BLOCK = 512


def cudnn_arguments(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window: int | None = None) -> dict:
    """Arguments of `jax.nn.dot_product_attention` for kiln's mask: causal and same document.

    JAX 0.10.2's `jax.nn.dot_product_attention` has no segment ids; packed documents are a
    boolean mask [B, 1, S, T] (same segment), which JAX turns into an additive bias that
    cuDNN reads from memory (B*S*T elements in the compute dtype), combined with cuDNN's own
    causal mask, which skips the blocks above the diagonal; a window is cuDNN's
    `local_window_size` (W-1 keys to the left, none to the right).
    """
    same_doc_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return dict(
        query=q_BSNH,
        key=k_BTKH,
        value=v_BTKH,
        mask=same_doc_B1ST,
        is_causal=True,
        scale=q_BSNH.shape[-1] ** -0.5,
        local_window_size=None if window is None else (window - 1, 0),
    )


HALF = (jnp.bfloat16, jnp.float16)


def check(name: str, platform: str, dtype, *, sinks: bool = False) -> None:
    """Refuse, in one line, an implementation that cannot run on `platform` for this `dtype`
    (or, `sinks`, for a model with attention sinks)."""
    if name == "cudnn" and sinks:
        raise KilnError(
            "model.attention: 'cudnn' has no attention sinks (model.attention_sinks: true); "
            "use 'xla'"
        )
    needs = {"cudnn": "gpu", "splash": "tpu"}.get(name)
    if needs is not None and platform != needs:
        raise KilnError(
            f"model.attention: got {name!r}, which runs on {needs.upper()} only, but the "
            f"devices are {platform!r}; use 'auto' or 'xla'"
        )
    if name == "cudnn" and jnp.dtype(dtype) not in HALF:
        raise KilnError(
            f"model.attention: 'cudnn' needs model.dtype bfloat16 or float16, got "
            f"{jnp.dtype(dtype).name}; use 'xla' for float32"
        )


def cudnn_attention(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, *, window=None, sinks_N=None):
    """cuDNN's fused attention (`jax.nn.dot_product_attention`), bf16/fp16 on NVIDIA GPUs.
    It has no attention sinks (refused when the model has them, `check`)."""
    check("cudnn", traced_platform(), q_BSNH.dtype, sinks=sinks_N is not None)
    k_BTKH, v_BTKH = constrain(k_BTKH, KV_WHOLE), constrain(v_BTKH, KV_WHOLE)
    args = cudnn_arguments(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window)
    try:
        return jax.nn.dot_product_attention(**args, implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError) as e:
        raise KilnError(f"model.attention: 'cudnn' refused this model: {e}; use 'xla'") from e


def splash_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    block: int = SPLASH_BLOCK,
    interpret: bool = False,
    window: int | None = None,
    sinks_N=None,
):
    """Pallas splash attention (TPU), under `shard_map` over batch and heads.

    Inside each shard one kernel call per batch row (vmapped), with a causal mask (a
    `LocalMask` of W-1 keys to the left with a window), the segment ids and the sinks (the
    kernel's own); the kernel skips the blocks the mask empties. On a sequence-sharded mesh
    (`model.context_parallel: all_gather`) each shard keeps its own queries and reads the
    keys and values gathered whole: the kernel is made for the whole [S, S] mask split into
    the shards' query rows (`q_seq_shards`), its mask blocks passed into the `shard_map` split
    the same way, so each shard computes only its rows' attention. Under load balance a
    shard's rows are chunks p and 2P-1-p: the mask's query positions are those
    (`balanced_order`), and the gathered keys go back in order inside the shard.
    `interpret=True` runs the kernel in Pallas' interpreter (CPU; tests only).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if not interpret:
        check("splash", traced_platform(), q_BSNH.dtype)
    s, h = q_BSNH.shape[1], q_BSNH.shape[3]
    blk = min(block, s)
    if s % blk or blk % 128:
        raise KilnError(
            f"model.attention: 'splash' needs data.seq_len a multiple of 128 (and of {block} "
            f"when longer), got {s}"
        )

    def make_kernel(heads: int, head_shards: int = 1, q_shards: int = 1, rows=None):
        """The kernel for `heads` query heads over the [S, S] mask, its query rows at positions
        `rows` (None: in order), split into `q_shards` pieces and the heads into
        `head_shards`; query blocks no longer than a piece."""
        bq = min(blk, s // q_shards)
        if (s // q_shards) % bq or bq % 128:
            raise KilnError(
                f"model.attention: 'splash' on {q_shards} sequence shards needs data.seq_len / "
                f"{q_shards} a multiple of 128 (and of {block} when longer), got {s // q_shards}"
            )
        if window is None:
            one = splash.CausalMask((s, s))
        else:
            one = splash.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
        if rows is not None:
            one.q_sequence = rows.astype(np.int32)
        sizes = dict(block_q=bq, block_kv=blk, block_q_dkv=bq, block_kv_dkv=blk)
        sizes.update(block_q_dq=bq, block_kv_dq=blk)
        return splash.make_splash_mha(
            splash.MultiHeadMask([one] * heads),
            block_sizes=splash.BlockSizes(**sizes),
            head_shards=head_shards,
            q_seq_shards=q_shards,
            interpret=interpret,
        )

    def run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N):
        # The kernel does not scale the scores: scale the queries (exact for H a power of 4).
        q_BNSH = (q_BSNH * h**-0.5).astype(q_BSNH.dtype).transpose(0, 2, 1, 3)
        k_BKTH, v_BKTH = k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)
        segments = splash.SegmentIds(q=seg_BS, kv=seg_BT)
        if sinks_N is None:
            out_BNSH = jax.vmap(kernel)(q_BNSH, k_BKTH, v_BKTH, segments)
        else:
            sinks_N = sinks_N.astype(jnp.float32)
            out_BNSH = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(
                q_BNSH, k_BKTH, v_BKTH, segments, sinks_N
            )
        return out_BNSH.transpose(0, 2, 1, 3)

    def per_shard(q_BSNH, k_BTKH, v_BTKH, seg_BS, sinks_N):
        kernel = make_kernel(q_BSNH.shape[2])
        return run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BS, sinks_N)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_shard(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, sinks_N)
    rules = current_rules()
    kv_spec = logical_spec(("batch", None, "act_kv_heads", None), rules)
    sinks_spec = None if sinks_N is None else logical_spec(("act_heads",), rules)
    p = sequence_shards()
    if p == 1:
        q_spec = logical_spec(("batch", None, "act_heads", None), rules)
        seg_spec = logical_spec(("batch", None), rules)
        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, seg_spec, sinks_spec),
            out_specs=q_spec,
            check_vma=False,
        )(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, sinks_N)

    # Sequence shards: each keeps its query rows; keys, values and their segment ids whole.
    heads_axes, seq_axes = mesh_axes(("act_heads", "length"), rules, dict(mesh.shape))
    balanced = rows_balanced()
    order = balanced_order(s, p) if balanced else None
    kernel = make_kernel(
        q_BSNH.shape[2],
        head_shards=int(np.prod([mesh.shape[a] for a in heads_axes])),
        q_shards=p,
        rows=order,
    )
    spec = jax.sharding.PartitionSpec(heads_axes or None, seq_axes)
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, spec))
    back = None if order is None else np.argsort(order)

    def per_rows(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N):
        if back is not None:  # the gathered keys are in balanced order: back in order
            k_BTKH, v_BTKH, seg_BT = (jnp.take(x, back, axis=1) for x in (k_BTKH, v_BTKH, seg_BT))
        return run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N)

    q_spec = logical_spec(("batch", "length", "act_heads", None), rules)
    seg_q_spec = logical_spec(("batch", "length"), rules)
    seg_kv_spec = logical_spec(("batch", None), rules)
    return jax.shard_map(
        per_rows,
        mesh=mesh,
        in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, seg_q_spec, seg_kv_spec, sinks_spec),
        out_specs=q_spec,
        check_vma=False,
    )(kernel, q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, segment_ids_BS, sinks_N)
