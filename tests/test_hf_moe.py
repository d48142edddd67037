"""Hugging Face interop of the moe family (Qwen3-MoE, Mixtral), checked against transformers
itself (CPU torch, float32).

Logits of the same weights in kiln and in `Qwen3MoeForCausalLM` / `MixtralForCausalLM` agree
within 1e-4 (float32, whole model, as tests/test_hf.py); greedy decoding agrees token for
token; export(import(x)) gives back x's tensors bit for bit.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import assert_user_error, kiln_main, write_config
from kiln.cli import main
from kiln.config import config_from_dict, load_config
from kiln.data.tokenizers import load_tokenizer
from kiln.runs.runmodel import load_run_model
from test_hf import all_tensors, edited_copy, hf_logits, kiln_logits, tokens, write_tokenizer

TOL = 1e-4  # whole-model float32 logits, kiln vs transformers (as tests/test_hf.py)
V = 128
ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=500.0,
    tie_word_embeddings=False,
)
TEXTS = ["the kiln fires", "clay at high heat"]


def random_moe(path: Path, kind: str) -> Path:
    """A random Qwen3-MoE (3 layers, the first dense, norm_topk_prob false, head_dim 16 !=
    d_model / heads) or Mixtral (2 layers), 4 experts top-2, with norm weights away from 1 and
    routers far from uniform (clear top-2 choices); saved in shards, with a tokenizer.json."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=4,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            router_aux_loss_coef=0.02,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        config = MixtralConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4
        )
        model = MixtralForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("gate.weight") else 0.1
            p.copy_(
                1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p)
            )
    model.save_pretrained(path, max_shard_size="40KB")
    write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> its random HF model directory."""
    tmp = tmp_path_factory.mktemp("hf")
    return {kind: random_moe(tmp / kind, kind) for kind in ARCH}


@pytest.fixture(scope="module", params=list(ARCH))
def imported(request, hf_dirs, tmp_path_factory):
    """(kind, HF directory, kiln run imported from it)."""
    kind, src = request.param, hf_dirs[request.param]
    run_dir = tmp_path_factory.mktemp(kind) / "imported"
    assert main(["import-hf", str(src), "--out", str(run_dir)]) == 0
    return kind, src, run_dir


def test_import_matches_transformers_and_round_trips_bitwise(imported, tmp_path):
    from transformers import AutoConfig

    kind, src, run_dir = imported
    hf_in = AutoConfig.from_pretrained(src)
    moe = load_config(run_dir / "config.yaml").model.moe
    assert moe.num_experts == 4 and moe.experts_per_token == 2
    assert moe.first_dense_layers == (1 if kind == "qwen3_moe" else 0)
    assert moe.norm_topk_prob is (kind == "mixtral")
    assert moe.load_balance_loss == hf_in.router_aux_loss_coef
    inputs = tokens(1)
    ours = kiln_logits(load_run_model(run_dir, context="test").model, inputs)
    np.testing.assert_allclose(ours, hf_logits(src, inputs, ARCH[kind]), atol=TOL, rtol=0)

    out = tmp_path / "exported"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    original, exported = all_tensors(src), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert exported[name].tobytes() == x.tobytes(), name
    hf_out = AutoConfig.from_pretrained(out)
    keys = ["num_local_experts", "num_experts_per_tok", "intermediate_size"]
    if kind == "qwen3_moe":
        keys += ["moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"]
    for key in [*keys, "decoder_sparse_step", "router_aux_loss_coef", "sliding_window"]:
        assert getattr(hf_out, key, None) == getattr(hf_in, key, None), key
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH[kind]), ours, atol=TOL, rtol=0)


def hf_greedy(hf_dir, kind, prompts, max_new_tokens, eos_id, architecture=None):
    """transformers' greedy continuation of each prompt (ending at EOS, if any), by the
    architecture of `kind` (or `architecture`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == (architecture or ARCH[kind])
    return greedy(model, prompts, max_new_tokens, eos_id)


def greedy(model, prompts, max_new_tokens, eos_id):
    """A loaded transformers model's greedy continuation of each prompt (ending at EOS)."""
    import torch

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
            )
        out.append(seq[0, len(prompt) :].tolist())
    return out


def kiln_greedy(run_dir, tmp_path, max_new_tokens=12):
    """`kiln generate RUN --temperature 0` over TEXTS: (its records, the prompts as it encodes
    them, the run's EOS id)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(run_dir), "--prompts", str(prompts), "--out", str(out)]
    assert main([*argv, "--temperature", "0", "--max-new-tokens", str(max_new_tokens)]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    tok = load_tokenizer(str(run_dir / "tokenizer.json"))
    # kiln generate starts each prompt with EOS, as every training document does.
    return got, [[tok.eos_id, *tok.encode(t)] for t in TEXTS], tok.eos_id


def test_greedy_generate_matches_transformers(imported, tmp_path):
    kind, src, run_dir = imported
    got, encoded, eos = kiln_greedy(run_dir, tmp_path)
    for record, want in zip(got, hf_greedy(src, kind, encoded, 12, eos), strict=True):
        assert record["tokens"] == want[: len(record["tokens"])]
        assert len(record["tokens"]) == 12 or record["finish"] == "eos"


def test_trained_run_exports_with_equal_logits(tmp_path):
    """3 steps of a Qwen3-MoE-shaped run (qk_norm, a dense first layer, both router losses,
    a capacity): the export loads in transformers with kiln's dropless logits."""
    tok = write_tokenizer(tmp_path / "tok.json")
    moe = dict(
        num_experts=4,
        experts_per_token=2,
        d_ff_expert=24,
        first_dense_layers=1,
        router_z_loss=1e-3,
        load_balance_loss=1e-2,
        capacity_factor=1.0,
    )
    model = dict(vocab_size=V, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48)
    cfg = write_config(
        tmp_path / "moe.yaml",
        model={**model, "family": "moe", "moe": moe, "qk_norm": True, "max_seq_len": 32},
        data={"source": "synthetic", "seq_len": 16, "tokenizer": str(tok)},
        mesh={"fsdp": -1},
        optim={"learning_rate": 1e-2, "warmup_steps": 0},
        train={"output_dir": str(tmp_path), "run_name": "moe", "steps": 3, "global_batch_size": 8},
    )
    trained = kiln_main("train", cfg)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir, out = tmp_path / "moe", tmp_path / "hf"
    exported = kiln_main("export-hf", run_dir, "--out", out)
    assert exported.returncode == 0, exported.stderr
    assert "note: model.moe.capacity_factor 1.0 not exported" in exported.stdout
    assert json.loads((out / "config.json").read_text())["mlp_only_layers"] == [0]

    # transformers routes every token (dropless): kiln's logits without the capacity.
    raw = load_config(run_dir / "config.yaml").model_dump()
    raw["model"]["moe"]["capacity_factor"] = None
    run = load_run_model(run_dir, context="test", config=config_from_dict(raw))
    assert run.step == 3
    inputs = tokens(2)
    ours = kiln_logits(run.model, inputs)
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH["qwen3_moe"]), ours, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("kind", "config", "drop", "message"),
    [
        (
            "qwen3_moe",
            {"mlp_only_layers": [1]},
            None,
            "mlp_only_layers [1] with decoder_sparse_step 1 give dense layers [1] of 3; kiln "
            "imports only dense layers 0..N-1 before the MoE layers",
        ),
        ("qwen3_moe", {"decoder_sparse_step": 2}, None, "give dense layers [0, 2] of 3"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, None, "experts_per_token (5) exceeds"),
        ("mixtral", {"sliding_window": 16}, None, "sliding_window is 16; kiln imports only null"),
        ("mixtral", {"router_jitter_noise": 0.1}, None, "router_jitter_noise is 0.1"),
        (
            "mixtral",
            None,
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "missing tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'",
        ),
    ],
    ids=["mlp_only_layers", "sparse_step", "top_k", "sliding_window", "jitter", "missing"],
)
def test_import_refusals_name_the_field(hf_dirs, tmp_path, kind, config, drop, message):
    src = edited_copy(hf_dirs[kind], tmp_path / "edited", config=config, drop=drop)
    out = tmp_path / "run"
    assert_user_error(kiln_main("import-hf", src, "--out", out), message)
    assert not out.exists()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"qk_norm": True, "moe": {"balance": "aux_free"}}, "model.moe.balance: aux_free, but"),
        ({"qk_norm": True, "moe": {"num_shared_experts": 1}}, "model.moe.num_shared_experts: 1"),
        ({"moe": {"first_dense_layers": 1}}, "model.moe.first_dense_layers: 1, but Mixtral"),
        ({"moe": {"norm_topk_prob": False}}, "model.moe.norm_topk_prob: false, but Mixtral"),
        ({"qk_norm": True, "moe": {"score": "sigmoid"}}, "model.moe.score: sigmoid, but"),
        (
            {"moe": {"num_experts": 8, "n_group": 4, "topk_group": 2}},
            "model.moe.n_group: 4, but Hugging Face MixtralForCausalLM routes by a softmax",
        ),
        (
            {"qk_norm": True, "moe": {"routed_scaling_factor": 2.5}},
            "model.moe.routed_scaling_factor: 2.5",
        ),
    ],
    ids=[
        "aux_free",
        "shared_experts",
        "mixtral_dense_layers",
        "mixtral_norm_topk_prob",
        "sigmoid",
        "groups",
        "scaling",
    ],
)
def test_export_refuses_what_hf_moe_cannot_hold(tmp_path, model, message):
    # Refused from config.yaml alone, before any checkpoint is read.
    config = config_from_dict(
        {
            "model": {"family": "moe", "vocab_size": V, "num_layers": 2, **model},
            "train": {"output_dir": str(tmp_path), "run_name": "r"},
        }
    )
    config.run_dir.mkdir()
    (config.run_dir / "config.yaml").write_text(config.to_yaml())
    out = tmp_path / "hf"
    assert_user_error(kiln_main("export-hf", config.run_dir, "--out", out), message)
    assert not out.exists()
