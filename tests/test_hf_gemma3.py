"""Hugging Face interop of the gemma3 family (Gemma3ForCausalLM), checked against transformers
itself (CPU torch, float32).

One random tiny Gemma 3 (shared by the tests) mixes sliding-window and global layers, with a
window shorter than the sequences, its own rotary base on the sliding layers, linear rope
scaling on the global ones, head_dim apart from d_model / heads and query_pre_attn_scalar
apart from head_dim: kiln's logits of the imported model agree with transformers' within 1e-4
(float32, whole model, as tests/test_hf.py), greedy decoding past the window agrees token for
token, export(import(x)) is x bit for bit, and a random kiln model exports, loads in
transformers with kiln's logits and imports back bit for bit.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from kiln.cli import main
from kiln.config import config_from_dict, load_config
from kiln.errors import KilnError
from kiln.model.interop import hf_config
from kiln.runs.runmodel import load_run_model
from test_hf import (
    B,
    S,
    all_tensors,
    edited_copy,
    hf_logits,
    kiln_logits,
    trained_run,
    write_tokenizer,
)
from test_hf_moe import hf_greedy, kiln_greedy

TOL = 1e-4  # whole-model float32 logits, kiln vs transformers (as tests/test_hf.py)
V = 128
ARCH = "Gemma3ForCausalLM"
WINDOW = 4  # < S = 16 and < the decoded length
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
}


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, S))


def random_gemma(path: Path) -> Path:
    """A random Gemma 3 of 3 layers (sliding, global, sliding; window 4), GQA 4/2 heads of 16
    (d_model 32), query_pre_attn_scalar 24, norm weights away from 0; saved in shards with a
    tokenizer.json."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=TYPES,
        rope_parameters={k: dict(v) for k, v in ROPE.items()},
        max_position_embeddings=64,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="40KB")
    write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return random_gemma(tmp_path_factory.mktemp("hf") / "gemma3")


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gemma3") / "imported"
    assert main(["import-hf", str(hf_dir), "--out", str(run_dir)]) == 0
    return run_dir


def test_import_matches_transformers_and_round_trips_bitwise(hf_dir, imported, tmp_path):
    from transformers import AutoConfig

    m = load_config(imported / "config.yaml").model
    assert (m.family, m.qk_norm, m.tie_embeddings, m.head_dim) == ("gemma3", True, True, 16)
    assert m.gemma3.query_pre_attn_scalar == 24 and m.layer_types == tuple(TYPES)
    assert (m.sliding_window, m.local_rope_theta, m.rope_theta) == (WINDOW, 100.0, 1000.0)
    assert m.rope_scaling.hf_fields() == {"rope_type": "linear", "factor": 4.0}
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
    keys = ["layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim"]
    for key in [*keys, "rope_parameters", "hidden_activation", "tie_word_embeddings"]:
        assert getattr(hf_out, key) == getattr(hf_in, key), key
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH), ours, atol=TOL, rtol=0)


def test_the_hubs_config_form_imports_as_the_same_model(hf_dir, imported, tmp_path):
    """The Hub's Gemma 3 config.json files predate transformers 5: rope_theta,
    rope_local_base_freq and the global layers' rope_scaling, and a sliding_window_pattern
    instead of layer_types (here 2: every second layer global)."""
    raw = json.loads((hf_dir / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    legacy |= {"rope_theta": 1000.0, "rope_local_base_freq": 100.0, "sliding_window_pattern": 2}
    legacy |= {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    src = edited_copy(hf_dir, tmp_path / "legacy")
    (src / "config.json").write_text(json.dumps(legacy))
    run_dir = tmp_path / "run"
    assert main(["import-hf", str(src), "--out", str(run_dir)]) == 0
    want = load_config(imported / "config.yaml").model
    got = load_config(run_dir / "config.yaml").model
    assert got == want


def test_greedy_generate_past_the_window_matches_transformers(hf_dir, imported, tmp_path):
    """kiln generate's cache (the sliding layers mask all but their window) and transformers'
    sliding-window cache: the same tokens over prompts plus 12 new tokens, longer than the
    window."""
    got, encoded, eos = kiln_greedy(imported, tmp_path)
    wanted = hf_greedy(hf_dir, "gemma3", encoded, 12, eos, architecture=ARCH)
    for record, want, prompt in zip(got, wanted, encoded, strict=True):
        assert record["tokens"] == want[: len(record["tokens"])]
        assert len(record["tokens"]) == 12 or record["finish"] == "eos"
        assert len(prompt) + len(record["tokens"]) > 2 * WINDOW


GEMMA = dict(
    family="gemma3",
    vocab_size=V,
    d_model=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    d_ff=48,
    qk_norm=True,
    tie_embeddings=True,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    local_rope_theta=100.0,
    rope_theta=1000.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
    gemma3={"query_pre_attn_scalar": 24},
    norm_eps=1e-6,
    max_seq_len=64,
)


def test_a_trained_run_exports_with_equal_logits_and_imports_back_bitwise(tmp_path):
    """A gemma3 run trained 2 steps (every parameter, norms included, moved by the optimizer)
    exports, loads in transformers with kiln's logits, and imports back bit for bit."""
    tok = write_tokenizer(tmp_path / "tok.json")
    raw = {
        "model": GEMMA,
        "mesh": {"fsdp": -1},
        "data": {"seq_len": S, "tokenizer": str(tok)},
        "train": {"output_dir": str(tmp_path), "run_name": "r", "global_batch_size": B},
    }
    config, run_dir = config_from_dict(raw), trained_run(raw)

    out = tmp_path / "hf"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "gemma3_text" and hf["query_pre_attn_scalar"] == 24
    assert hf["rope_local_base_freq"] == 100.0 and hf["rope_scaling"]["rope_type"] == "linear"
    run = load_run_model(run_dir, context="test")
    inputs = tokens(2)
    ours = kiln_logits(run.model, inputs)
    np.testing.assert_allclose(hf_logits(out, inputs, ARCH), ours, atol=TOL, rtol=0)

    back = tmp_path / "back"
    assert main(["import-hf", str(out), "--out", str(back)]) == 0
    assert load_config(back / "config.yaml").model == config.model
    want = nnx.to_flat_state(nnx.state(run.model, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(load_run_model(back, context="test").model, nnx.Param)))
    for path, var in want:
        assert np.asarray(got[path].get_value()).tobytes() == np.asarray(var.get_value()).tobytes()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0; kiln imports only"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0; kiln imports only"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is True"),
        ({"hidden_activation": "gelu"}, "hidden_activation is 'gelu'"),
        (
            {"rope_parameters": {**ROPE, "sliding_attention": ROPE["full_attention"]}},
            "rope_parameters.sliding_attention is",
        ),
        (
            {"layer_types": None, "sliding_window_pattern": 0},
            "sliding_window_pattern is 0; kiln imports only an integer >= 1",
        ),
    ],
    ids=["final_softcap", "attn_softcap", "bidirectional", "activation", "sliding_rope", "pattern"],
)
def test_import_refusals_name_the_field(hf_dir, tmp_path, capsys, config, message):
    src = edited_copy(hf_dir, tmp_path / "edited", config=config)
    out = tmp_path / "run"
    assert main(["import-hf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"qk_norm": False}, "model.qk_norm is false with model.family gemma3; allowed: true"),
        ({"logit_softcap": 30.0}, "model.logit_softcap: 30.0, but kiln reads"),
        ({"local_rope_theta": None}, "model.local_rope_theta: None, but"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "low_freq_factor": 2.0}},
            "low_freq_factor is 2.0 with rope_type linear; allowed: null",
        ),
    ],
    ids=["qk_norm", "softcap", "local_theta", "linear_fields"],
)
def test_config_and_export_refusals_name_the_field(edit, message):
    """Refused by the config (a training run would be) or by export (Gemma3ForCausalLM cannot
    hold it), in one line naming the field."""
    raw = {"model": {**GEMMA, **edit}, "data": {"seq_len": S}, "train": {"run_name": "r"}}
    with pytest.raises(KilnError) as e:
        hf_config(config_from_dict(raw).model, 0, 0)
    assert len(str(e.value).splitlines()) == 1 and message in str(e.value), str(e.value)


def test_the_cli_refuses_a_gemma3_config_without_qk_norm_in_one_line(tmp_path, capsys):
    path = tmp_path / "g.yaml"
    path.write_text(json.dumps({"model": {**GEMMA, "qk_norm": False}, "data": {"seq_len": S}}))
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.qk_norm is false with model.family gemma3" in err[0], err
