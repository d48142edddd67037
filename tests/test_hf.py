"""Hugging Face Llama interop, checked against transformers itself (CPU torch, float32).

Logits of the same weights in kiln and in `LlamaForCausalLM` agree within 1e-4 (float32, whole
model); export(import(x)) gives back x's tensors bit for bit.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sentencepiece as spm
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import run_process
from kiln.cli import main
from kiln.config import config_from_dict, load_config
from kiln.data.tokenizers import load_tokenizer
from kiln.distill.teacher import load_teacher
from kiln.model.llama import rope_frequencies
from kiln.parallel.mesh import make_mesh
from kiln.runs.checkpoint import Checkpointer
from kiln.runs.restore import restore_params
from kiln.training.loop import checkpoint_tree
from kiln.training.train import init_state

B, S, V = 8, 16, 96
TOL = 1e-4  # whole-model float32 logits, kiln vs transformers
SIZES = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32)
WORDS = ["<|endoftext|>", "[UNK]", "the", "kiln", "fires", "clay", "at", "high", "heat"]


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, S))


def kiln_logits(model, inputs):
    positions = np.broadcast_to(np.arange(S), (B, S))
    hidden = model.hidden_states(inputs, positions, np.ones((B, S), np.int32)).hidden
    return np.asarray(model.logits(hidden))


def hf_logits(hf_dir, inputs, architecture="LlamaForCausalLM"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert type(model).__name__ == architecture
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(inputs)).logits.numpy()


def write_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def write_sentencepiece(path: Path) -> Path:
    """A BPE sentencepiece model, the kind Llama's tokenizer.model is."""
    lines = ["the kiln fires clay at high heat", "pottery, glaze and fire"] * 50
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(path.with_suffix("")),
        model_type="bpe",
        vocab_size=40,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
    )
    return path


def kiln_run(tmp_path: Path, *, data=None, **model) -> tuple[Path, object]:
    """A saved step-0 run with random weights (norm scales too); returns (run dir, state)."""
    raw = {
        "model": {"vocab_size": V, **SIZES, "init_std": 0.1, "rope_theta": 500.0, **model},
        "mesh": {"fsdp": -1},
        "data": {"seq_len": S, **(data or {})},
        "train": {"output_dir": str(tmp_path / "runs"), "run_name": "r", "global_batch_size": B},
    }
    config = config_from_dict(raw)
    m = config.model
    if m.logit_softcap or m.sliding_window or m.attention_sinks:
        config.run_dir.mkdir(parents=True)
        (config.run_dir / "config.yaml").write_text(config.to_yaml())
        return config.run_dir, None  # export refuses it before reading any checkpoint
    return noised_run(config, 0.1)


def noised_run(config, scale: float) -> tuple[Path, object]:
    """A run directory of `config` saved at step 0, every parameter (norms too) its initial
    value plus `scale` x standard normal noise; returns (run dir, state)."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    state = init_state(config)
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    state = state.replace(params=jax.tree.unflatten(treedef, noisy))
    ckpt = Checkpointer(run_dir, config.checkpoint)
    ckpt.save(0, checkpoint_tree(state), {})
    ckpt.close()
    return run_dir, state


def trained_run(raw: dict, steps: int = 2) -> Path:
    """The run of config `raw` (a dict) trained `steps` steps on synthetic tokens from its
    initialisation (learning rate 1e-2, no warm-up), in this process: every parameter, norms,
    biases and sinks included, moved by the optimizer. Returns the run directory."""
    raw = {
        **raw,
        "data": {**raw["data"], "source": "synthetic"},
        "optim": {"learning_rate": 1e-2, "warmup_steps": 0},
        "train": {**raw["train"], "steps": steps},
    }
    config = config_from_dict(raw)
    path = Path(config.train.output_dir) / "trained.yaml"
    path.write_text(config.to_yaml())
    assert main(["train", str(path)]) == 0
    return config.run_dir


def random_hf_model(path: Path, dtype: str = "float32", **overrides) -> Path:
    """A random LlamaForCausalLM (GQA, norm weights away from 1) saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    # Small shards: the import reads model.safetensors.index.json and several files.
    model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="40KB")
    return path


def all_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, tied):
    write = write_tokenizer if tied else write_sentencepiece
    spec = str(write(tmp_path / ("tok.json" if tied else "sp.model")))
    data = {"tokenizer": spec}
    run_dir, state = kiln_run(tmp_path, data=data, tie_embeddings=tied)
    out = tmp_path / "hf"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0

    names = load_file(out / "model.safetensors").keys()
    assert ("lm_head.weight" in names) is not tied
    inputs = tokens()
    np.testing.assert_allclose(
        hf_logits(out, inputs), kiln_logits(state.model(), inputs), atol=TOL, rtol=0
    )
    hf_cfg = json.loads((out / "config.json").read_text())
    kiln_tok = load_tokenizer(spec)
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (kiln_tok.bos_id, kiln_tok.eos_id)
    text = "the kiln fires clay at high heat"
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(text, add_special_tokens=False) == kiln_tok.encode(text)
    special = (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert special == (kiln_tok.bos_id, kiln_tok.eos_id, kiln_tok.pad_id)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors alone would be 0600


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return random_hf_model(tmp_path_factory.mktemp("hf") / "llama")


def test_import_matches_transformers_and_round_trips_bitwise(tmp_path, hf_model, capsys):
    assert (hf_model / "model.safetensors.index.json").is_file()
    run_dir = tmp_path / "runs" / "imported"
    assert main(["import-hf", str(hf_model), "--out", str(run_dir)]) == 0

    # No training data yet: kiln train refuses in one line and leaves the run untouched.
    files = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    capsys.readouterr()
    assert main(["train", str(run_dir / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "data.source: 'none'" in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == files

    # As checkpoint.load_params_from restores it.
    config = load_config(run_dir / "config.yaml")
    assert (config.train.output_dir, config.train.run_name) == (str(run_dir.parent), "imported")
    state = init_state(config)
    params, step, _ = restore_params(run_dir, state.params)
    assert step == 0
    inputs = tokens(1)
    np.testing.assert_allclose(
        kiln_logits(state.replace(params=params).model(), inputs),
        hf_logits(hf_model, inputs),
        atol=TOL,
        rtol=0,
    )

    # As distillation.teacher_run_dir loads it.
    student = config_from_dict(
        {**config.model_dump(), "distillation": {"teacher_run_dir": str(run_dir)}}
    )
    teacher = load_teacher(student, make_mesh(student))
    for a, b in zip(jax.tree.leaves(teacher.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out = tmp_path / "exported"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    original, exported = all_tensors(hf_model), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert exported[name].dtype == x.dtype, name
        assert exported[name].tobytes() == x.tobytes(), name
    hf_in = json.loads((hf_model / "config.json").read_text())
    hf_out = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "rms_norm_eps"):
        assert hf_out[key] == hf_in[key], key
    assert hf_out["rope_parameters"] == hf_in["rope_parameters"]
    # No tokenizer in the source: the run falls back to kiln's byte tokenizer, not exported.
    assert hf_out["eos_token_id"] == 257
    assert not (out / "tokenizer.json").exists() and not (out / "tokenizer.model").exists()


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 8, theta 500: wavelengths 6.3, 30, 140, 665 -> one kept (< 32/4), one
    # interpolated, two stretched (> 32/1): every branch of the rescaling is used.
    "original_max_position_embeddings": 32,
}


def test_llama3_rope_scaling_matches_transformers_and_exports(tmp_path):
    src = random_hf_model(tmp_path / "llama3", rope_parameters={**LLAMA3, "rope_theta": 500.0})
    # As Llama 3.1's config.json on the Hub: the legacy rope_scaling key, rope_theta beside it.
    legacy = edited_copy(src, tmp_path / "legacy", config={"rope_scaling": LLAMA3})
    raw = json.loads((legacy / "config.json").read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    (legacy / "config.json").write_text(json.dumps(raw))
    run_dir = tmp_path / "runs" / "llama3"
    assert main(["import-hf", str(legacy), "--out", str(run_dir)]) == 0
    config = load_config(run_dir / "config.yaml")
    assert config.model.rope_scaling.model_dump() == LLAMA3
    state = init_state(config)
    params, _, _ = restore_params(run_dir, state.params)
    inputs = tokens(2)
    ours = kiln_logits(state.replace(params=params).model(), inputs)
    np.testing.assert_allclose(ours, hf_logits(src, inputs), atol=TOL, rtol=0)
    # The rescaling changes every frequency but the first (kept) one: the test sees it.
    scaled = rope_frequencies(4, 500.0, tuple(LLAMA3.values())[1:])
    assert (np.abs(scaled / rope_frequencies(4, 500.0, None) - 1) > 0.4).sum() == 3

    out = tmp_path / "exported"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"] == {**LLAMA3, "rope_theta": 500.0}
    np.testing.assert_allclose(hf_logits(out, inputs), ours, atol=TOL, rtol=0)


def test_bfloat16_round_trips_bitwise(tmp_path):
    src = random_hf_model(tmp_path / "bf16", dtype="bfloat16")
    run_dir = tmp_path / "runs" / "bf16"
    assert main(["import-hf", str(src), "--out", str(run_dir)]) == 0
    assert load_config(run_dir / "config.yaml").model.param_dtype == "bfloat16"
    out = tmp_path / "exported"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    original, exported = all_tensors(src), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, x in original.items():
        assert str(exported[name].dtype) == "bfloat16", name
        assert exported[name].tobytes() == x.tobytes(), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def kiln_cli(*args):
    return run_process([sys.executable, "-m", "kiln.cli", *args])


def edited_copy(src: Path, dst: Path, config=None, drop=None) -> Path:
    """A copy of an HF directory with config.json fields changed or a tensor removed."""
    dst.mkdir()
    for f in src.iterdir():
        dst.joinpath(f.name).write_bytes(f.read_bytes())
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    if drop:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        shard = dst / index["weight_map"][drop]
        tensors = load_file(shard)
        del tensors[drop]
        save_file(tensors, shard)
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "mistral"}, "model_type is 'mistral'; kiln imports only 'llama'"),
        ({"intermediate_size": 80}, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape"),
    ],
    ids=["architecture", "shape"],
)
def test_import_refusals_exit_2_with_one_line(tmp_path, hf_model, edit, message):
    src = edited_copy(hf_model, tmp_path / "edited", config=edit)
    out = tmp_path / "run"
    proc = kiln_cli("import-hf", str(src), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("config", "drop", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, "rope_scaling is"),
        (
            {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": 1},
            None,
            "use_sliding_window is 1; kiln imports only full attention",
        ),
        ({"attention_bias": True}, None, "attention_bias is True"),
        ({"mlp_bias": True}, None, "mlp_bias is True"),
        ({"num_key_value_heads": 3}, None, "model.num_kv_heads"),
        (None, "model.norm.weight", "missing tensor 'model.norm.weight'"),
    ],
    ids=["rope_scaling", "sliding_window", "attention_bias", "mlp_bias", "kv_heads", "missing"],
)
def test_import_refusals_name_the_field(tmp_path, hf_model, capsys, config, drop, message):
    src = edited_copy(hf_model, tmp_path / "edited", config=config, drop=drop)
    out = tmp_path / "run"
    assert main(["import-hf", str(src), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "model",
    [{"logit_softcap": 30.0}, {"sliding_window": 8}, {"attention_sinks": True}],
    ids=["logit_softcap", "sliding_window", "attention_sinks"],
)
def test_export_refuses_what_llama_cannot_hold(tmp_path, capsys, model):
    run_dir, _ = kiln_run(tmp_path, **model)
    out = tmp_path / "hf"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 2
    (field,) = model
    err = capsys.readouterr().err
    assert f"model.{field}" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_qk_norm_exports_as_qwen3_with_equal_logits_and_round_trips(tmp_path):
    run_dir, state = kiln_run(tmp_path, qk_norm=True)
    out = tmp_path / "qwen3"
    assert main(["export-hf", str(run_dir), "--out", str(out)]) == 0
    assert "model.layers.1.self_attn.k_norm.weight" in load_file(out / "model.safetensors")
    inputs = tokens(3)
    ours = kiln_logits(state.model(), inputs)
    np.testing.assert_allclose(hf_logits(out, inputs, "Qwen3ForCausalLM"), ours, atol=TOL, rtol=0)

    back = tmp_path / "runs" / "back"
    assert main(["import-hf", str(out), "--out", str(back)]) == 0
    assert load_config(back / "config.yaml").model.qk_norm
    again = tmp_path / "again"
    assert main(["export-hf", str(back), "--out", str(again)]) == 0
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert sorted(first) == sorted(second)
    for name, x in first.items():
        assert second[name].tobytes() == x.tobytes(), name
