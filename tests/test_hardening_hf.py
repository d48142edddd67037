"""Attacks on `kiln import-hf` through the directory it reads: a config.json that names more
layers or experts than its weights hold (or more than any bound allows), and inputs that are not
regular files. Each is refused with exit code 2 and one line naming the field or the path, before
a weight is read or anything is listed per layer or per expert, and nothing is written.

A row runs `kiln` in this process (`kiln_main`), or as a subprocess where the process itself is
under test: one whose memory and CPU time are capped (a list of every tensor of 10^9 layers
ends there instead of filling the machine), one that would block on a named pipe.
"""

import json
import os
import resource
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import assert_user_error, files, kiln, kiln_env, kiln_main, run_process
from test_hf import write_tokenizer

D, F, V, HEADS, HEAD_DIM = 8, 16, 32, 2, 4
TINY = np.zeros(1, np.float32)
# A capped `kiln import-hf` subprocess's address space and CPU time: the command needs a
# fraction of each (a refusal, a few seconds of CPU), a list of the tensors of 10^9 layers or
# experts many times more.
MEMORY_LIMIT = 4 << 30
CPU_LIMIT_S = 60


def mixtral(layers: int = 2, experts: int = 2) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, tensors) of a tiny Mixtral that `kiln import-hf` imports."""
    config = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "num_local_experts": experts,
        "num_experts_per_tok": 1,
        "max_position_embeddings": 32,
    }
    shapes = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
            p + "self_attn.k_proj.weight": (HEAD_DIM, D),
            p + "self_attn.v_proj.weight": (HEAD_DIM, D),
            p + "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "block_sparse_moe.gate.weight": (experts, D),
        }
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {q + "w1.weight": (F, D), q + "w3.weight": (F, D), q + "w2.weight": (D, F)}
    return config, {name: np.full(shape, 0.5, np.float32) for name, shape in shapes.items()}


def named(layers: int, experts: int, module: str = "mlp") -> dict[str, np.ndarray]:
    """One tiny tensor under each name of a layer's attention and routed experts: enough for
    the checks made before any tensor's shape is read."""
    out = {}
    for i in range(layers):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = TINY
        for e in range(experts):
            for linear in ("gate_proj", "up_proj", "down_proj"):
                out[f"model.layers.{i}.{module}.experts.{e}.{linear}.weight"] = TINY
    return out


def write_hf(path: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 2) -> Path:
    """An HF directory: config.json and `tensors` in `shards` files that
    model.safetensors.index.json lists."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, path / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def kiln_limited(*args, cwd: Path):
    """`kiln ARGS` in a subprocess with at most MEMORY_LIMIT bytes of address space and
    CPU_LIMIT_S seconds of CPU time (then the kernel ends it)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, CPU_LIMIT_S))

    cmd = [sys.executable, "-m", "kiln.cli", *map(str, args)]
    return run_process(cmd, cwd=cwd, env=kiln_env(), preexec_fn=limit)


def refused(tmp_path: Path, src: Path, runner, *needles: str) -> None:
    """`kiln import-hf SRC --out tmp_path/run`: exit 2, one line holding every needle, and
    nothing written (no run directory, no file of `tmp_path` added or changed)."""
    out = tmp_path / "run"
    before = files(tmp_path)
    assert_user_error(runner("import-hf", src, "--out", out, cwd=tmp_path), *needles)
    assert files(tmp_path) == before
    assert not out.exists()


def gemma3_config(layers) -> dict:
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
    }


def qwen3_moe_config(layers, experts) -> dict:
    return {
        **gemma3_config(layers),
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "moe_intermediate_size": F,
        "num_experts": experts,
        "num_experts_per_tok": 1,
    }


def deepseek_config(layers, experts) -> dict:
    return {
        **gemma3_config(layers),
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "moe_intermediate_size": F,
        "n_routed_experts": experts,
        "num_experts_per_tok": 1,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 4,
    }


def _edited_mixtral(**fields):
    config, tensors = mixtral()
    return {**config, **fields}, tensors


def _sparse_mixtral():
    """2,000 layers with 4,096 experts in the first only: config.json's counts are each held,
    but the tensors of every layer's experts would be 24.6 million names."""
    config, one_layer = mixtral(layers=1, experts=0)
    config |= {"num_hidden_layers": 2000, "num_local_experts": 4096}
    tensors = {n: TINY for n in one_layer if not n.startswith("model.layers.")}
    for i in range(2000):
        layer = (n.replace("layers.0.", f"layers.{i}.") for n in one_layer if "layers.0." in n)
        tensors |= dict.fromkeys(layer, TINY)
    for e in range(4096):
        for linear in ("w1", "w3", "w2"):
            tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{linear}.weight"] = TINY
    return config, tensors


# (how kiln runs, the directory's config.json and tensors, the needles of the one line)
COUNTS = {
    "num_hidden_layers 10^9": (
        kiln_limited,
        lambda: _edited_mixtral(num_hidden_layers=10**9),
        ["config.json: num_hidden_layers is 1000000000, but the weights hold 2 layers; allowed: "
         "at most 2 (config.json must describe the weights beside it)"],
    ),
    "num_local_experts 10^9": (
        kiln_limited,
        lambda: _edited_mixtral(num_local_experts=10**9),
        ["config.json: num_local_experts is 1000000000; kiln imports only an integer from 1 to "
         "65536"],
    ),
    "gemma3 num_hidden_layers 10^9 (a list of layer types)": (
        kiln_limited,
        lambda: (gemma3_config(10**9), named(2, 0)),
        ["config.json: num_hidden_layers is 1000000000, but the weights hold 2 layers"],
    ),
    "qwen3_moe num_hidden_layers 1e9 (a float)": (
        kiln_main,
        lambda: (qwen3_moe_config(1e9, 2), named(2, 2)),
        ["config.json: num_hidden_layers is 1000000000.0; kiln imports only an integer from 1 "
         "to 2147483647"],
    ),
    "qwen3_moe num_experts 3 of 2": (
        kiln_main,
        lambda: (qwen3_moe_config(2, 3), named(2, 2)),
        ["config.json: num_experts is 3, but the weights hold 2 experts; allowed: at most 2"],
    ),
    "deepseek_v3 n_routed_experts 65536 of 2": (
        kiln_main,
        lambda: (deepseek_config(2, 65536), named(2, 2)),
        ["config.json: n_routed_experts is 65536, but the weights hold 2 experts"],
    ),
    "2000 layers and 4096 experts, not in every layer": (
        kiln_limited,
        _sparse_mixtral,
        ["missing tensor 'model.layers.1.block_sparse_moe.experts.0.w1.weight'"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(COUNTS.values()), ids=list(COUNTS))
def test_counts_are_checked_against_the_weights_before_any_list(tmp_path, row):
    runner, make, needles = row
    src = write_hf(tmp_path / "hf", *make())
    refused(tmp_path, src, runner, *needles)


# (how kiln runs, what is replaced by a named pipe)
PIPES = {
    "a shard": (kiln, "model-00002-of-00002.safetensors"),
    "config.json": (kiln_main, "config.json"),
    "the index": (kiln_main, "model.safetensors.index.json"),
    "tokenizer.json": (kiln_main, "tokenizer.json"),
    "tokenizer_config.json": (kiln_main, "tokenizer_config.json"),
}


@pytest.mark.parametrize("row", list(PIPES.values()), ids=list(PIPES))
def test_inputs_that_are_not_regular_files_are_refused_before_opening(tmp_path, row):
    """A named pipe nobody writes blocks its reader forever: refused by its path."""
    runner, name = row
    src = write_hf(tmp_path / "hf", *mixtral())
    write_tokenizer(src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text("{}")
    (src / name).unlink()
    os.mkfifo(src / name)
    refused(tmp_path, src, runner, f"{src / name}: a named pipe (FIFO), not a regular file; "
            "allowed: a regular file or a link to one")  # fmt: skip


def test_the_tiny_checkpoint_imports(tmp_path):
    """The directory the refusals above edit is one kiln imports."""
    src = write_hf(tmp_path / "hf", *mixtral())
    write_tokenizer(src / "tokenizer.json")
    proc = kiln_main("import-hf", src, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "2 layers, 2 experts (top 1)" in proc.stdout
    assert "tokenizer tokenizer.json" in proc.stdout
