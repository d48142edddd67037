"""Hugging Face interop of the deepseek family (DeepseekV3ForCausalLM), checked against
transformers itself (CPU torch, float32).

Logits of the same weights in kiln and transformers agree within 1e-4 (float32, whole model,
as tests/test_hf.py), with latent attention through low-rank queries, YaRN (its mscale in the
softmax), sigmoid group-limited routing with a correction bias and shared experts; greedy
decoding (kiln's latent cache) agrees token for token; export(import(x)) gives back x's
tensors bit for bit, and a trained run with a multi-token prediction module exports, loads in
transformers with kiln's logits, and imports back bit for bit, module included.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import assert_user_error, kiln_main, write_config
from kiln.cli import main
from kiln.config import load_config
from kiln.runs.runmodel import load_run_model
from test_hf import all_tensors, edited_copy, hf_logits, kiln_logits, tokens, write_tokenizer
from test_hf_moe import hf_greedy, kiln_greedy

TOL = 1e-4  # whole-model float32 logits, kiln vs transformers (as tests/test_hf.py)
V = 128
ARCH = "DeepseekV3ForCausalLM"
YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def random_deepseek(path: Path) -> Path:
    """A random DeepSeek-V3 of 3 layers (the first dense), 8 experts in 4 groups (top-2 of 2
    groups), one shared expert, low-rank queries, YaRN; norm weights away from 1, routers far
    from uniform and correction biases that change the choices; saved in shards with a
    tokenizer.json."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters=dict(YARN),
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("gate.weight") else 0.1
            p.copy_(
                1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p)
            )
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(path, max_shard_size="40KB")
    write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return random_deepseek(tmp_path_factory.mktemp("hf") / "deepseek")


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("deepseek") / "imported"
    assert main(["import-hf", str(hf_dir), "--out", str(run_dir)]) == 0
    return run_dir


def test_import_matches_transformers_and_round_trips_bitwise(hf_dir, imported, tmp_path):
    from transformers import AutoConfig

    m = load_config(imported / "config.yaml").model
    assert m.family == "deepseek" and m.moe.score == "sigmoid" and m.moe.n_group == 4
    assert m.deepseek.q_lora_rank == 16 and m.deepseek.yarn.factor == 4.0
    # transformers' save carries num_nextn_predict_layers but not the modules: none imported.
    assert m.deepseek.mtp_num_layers == 0
    inputs = tokens(1)
    ours = kiln_logits(load_run_model(imported, context="test").model, inputs)
    np.testing.assert_allclose(ours, hf_logits(hf_dir, inputs, ARCH), atol=TOL, rtol=0)

    out = tmp_path / "exported"
    assert main(["export-hf", str(imported), "--out", str(out)]) == 0
    original, exported = all_tensors(hf_dir), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert exported[name].tobytes() == x.tobytes(), name
    hf_in, hf_out = AutoConfig.from_pretrained(hf_dir), AutoConfig.from_pretrained(out)
    keys = ["n_routed_experts", "n_group", "topk_group", "routed_scaling_factor", "q_lora_rank"]
    keys += ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace"]
    for key in [*keys, "rope_parameters", "rope_interleave", "norm_topk_prob"]:
        assert getattr(hf_out, key) == getattr(hf_in, key), key
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH), ours, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(hf_dir, imported, tmp_path):
    """kiln generate decodes from its cache of latents and rotary keys (queries absorbed into
    the latent space); transformers expands keys and values: the same tokens."""
    got, encoded, eos = kiln_greedy(imported, tmp_path)
    wanted = hf_greedy(hf_dir, "deepseek", encoded, 12, eos, architecture=ARCH)
    for record, want in zip(got, wanted, strict=True):
        assert record["tokens"] == want[: len(record["tokens"])]
        assert len(record["tokens"]) == 12 or record["finish"] == "eos"


def test_trained_run_with_a_prediction_module_exports_and_imports_bitwise(tmp_path):
    """3 steps of a DeepSeek-shaped run with one multi-token prediction module: the export
    holds the module as DeepSeek's checkpoints do (layer num_layers, with copies of the
    embedding and head), loads in transformers (which skips the module) with kiln's logits,
    and imports back to the trained parameters bit for bit, module included."""
    tok = write_tokenizer(tmp_path / "tok.json")
    moe = dict(
        num_experts=8,
        experts_per_token=2,
        d_ff_expert=16,
        num_shared_experts=1,
        score="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        balance="aux_free",
    )
    deepseek = dict(
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mtp_num_layers=1
    )
    # One routed layer (import and export of a dense first layer: the fixture's model above).
    model = dict(vocab_size=V, d_model=32, num_layers=1, num_heads=4, d_ff=48, norm_eps=1e-6)
    cfg = write_config(
        tmp_path / "ds.yaml",
        model={**model, "family": "deepseek", "moe": moe, "deepseek": deepseek, "max_seq_len": 32},
        data={"source": "synthetic", "seq_len": 16, "tokenizer": str(tok)},
        mesh={"fsdp": -1},
        optim={"learning_rate": 1e-2, "warmup_steps": 0},
        train={"output_dir": str(tmp_path), "run_name": "ds", "steps": 3, "global_batch_size": 8},
    )
    trained = kiln_main("train", cfg)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir, out = tmp_path / "ds", tmp_path / "hf"
    exported = kiln_main("export-hf", run_dir, "--out", out)
    assert exported.returncode == 0, exported.stderr
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 1 and hf["rope_interleave"] is True
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.1.eh_proj.weight"].shape == (32, 64)
    assert np.array_equal(
        tensors["model.layers.1.shared_head.head.weight"], tensors["lm_head.weight"]
    )

    run = load_run_model(run_dir, context="test")
    inputs = tokens(2)
    ours = kiln_logits(run.model, inputs)
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH), ours, atol=TOL, rtol=0)

    back = tmp_path / "back"
    assert kiln_main("import-hf", out, "--out", back).returncode == 0
    assert load_config(back / "config.yaml").model.deepseek.mtp_num_layers == 1
    want = nnx.to_flat_state(nnx.state(run.model, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(load_run_model(back, context="test").model, nnx.Param)))
    for path, var in want:
        assert np.asarray(got[path].get_value()).tobytes() == np.asarray(var.get_value()).tobytes()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rope_interleave": False}, "rope_interleave is False; kiln imports only true"),
        ({"scoring_func": "softmax"}, "scoring_func is 'softmax'"),
        ({"n_group": 3}, "n_group (3) does not divide num_experts (8)"),
        (
            {"rope_parameters": {**YARN, "attention_factor": 2.0}, "rope_scaling": None},
            "rope_parameters is",
        ),
    ],
    ids=["interleave", "softmax", "groups", "attention_factor"],
)
def test_import_refusals_name_the_field(hf_dir, tmp_path, config, message):
    src = edited_copy(hf_dir, tmp_path / "edited", config=config)
    out = tmp_path / "run"
    assert_user_error(kiln_main("import-hf", src, "--out", out), message)
    assert not out.exists()
