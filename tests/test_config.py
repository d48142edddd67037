"""Config loading, overrides, validation and the CLI's handling of bad input."""

import math
import re
import typing

import pydantic
import pytest
import yaml

from conftest import (
    REPO,
    assert_user_error,
    communicate,
    kiln,
    kiln_main,
    make_config,
    start_kiln,
    write_config,
)
from kiln.config import MESH_AXES, Config, MeshConfig, check_devices, load_config, schema_rows
from kiln.errors import KilnError

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, Config)


def test_configs_directory_is_not_empty():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert {"tiny.yaml", "base.yaml", "models/llama3-1b.yaml", "models/llama3-8b.yaml"} <= names


def test_overrides_nested_lists_scientific_and_booleans(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "model: {d_model: 64, num_heads: 4}\n")
    c = load_config(
        cfg,
        [
            "model.d_model=128",
            "data.paths=[a.txt,b.txt]",
            "loss.z_loss_multiplier=1e-4",
            "model.tie_embeddings=true",
            "mesh.rules.vocab=[]",
            "checkpoint.load_params_from=null",
        ],
    )
    assert c.model.d_model == 128
    assert c.data.paths == ["a.txt", "b.txt"]
    assert c.loss.z_loss_multiplier == 1e-4
    assert c.model.tie_embeddings is True
    assert c.mesh.rules["vocab"] == []
    assert c.mesh.rules["mlp"] == ["tensor"]  # rules not given keep their defaults
    assert c.checkpoint.load_params_from is None


def test_scientific_notation_in_yaml_files(tmp_path):
    # YAML 1.1 reads `1e-4` as a string; the schema must still take it as a number.
    c = load_config(write_config(tmp_path / "c.yaml", "loss: {z_loss_multiplier: 1e-4}\n"))
    assert c.loss.z_loss_multiplier == 1e-4


def test_base_config_chain_of_three(tmp_path):
    (tmp_path / "sub").mkdir()
    write_config(tmp_path / "a.yaml", "model: {d_model: 64, num_layers: 2}\ntrain: {steps: 7}\n")
    write_config(tmp_path / "sub" / "b.yaml", "base_config: ../a.yaml\nmodel: {num_layers: 3}\n")
    c = write_config(tmp_path / "sub" / "c.yaml", "base_config: b.yaml\nmodel: {num_heads: 2}\n")
    config = load_config(c, ["train.steps=9"])
    assert (config.model.d_model, config.model.num_layers, config.model.num_heads) == (64, 3, 2)
    assert config.train.steps == 9


def test_base_config_loop_is_detected(tmp_path):
    write_config(tmp_path / "a.yaml", "base_config: b.yaml\n")
    write_config(tmp_path / "b.yaml", "base_config: a.yaml\n")
    with pytest.raises(KilnError, match="loop"):
        load_config(tmp_path / "a.yaml")


def test_config_is_frozen():
    c = Config()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.loss.z_loss_multiplier = 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.z_loss_multiplier=nan"], "loss.z_loss_multiplier"),
        (["loss.z_loss_multiplier=.inf"], "loss.z_loss_multiplier"),
        (["loss.z_loss_multiplier=-1e-4"], "loss.z_loss_multiplier"),
        (["loss.num_vocab_tiling=0"], "loss.num_vocab_tiling"),
        (["loss.label_smoothing=1.0"], "loss.label_smoothing"),
        (["optim.learning_rate=0"], "optim.learning_rate"),
        (["optim.warmup_steps=11", "train.steps=10"], "optim.warmup_steps"),
        (["optim.name=sgd"], "optim.name"),
        (
            ["optim.lion.b1=0.8"],
            "optim.lion: set, but optim.name is adamw; allowed: optim.name=lion",
        ),
        (["optim.name=muon", "optim.muon.ns_steps=0"], "optim.muon.ns_steps"),
        (["optim.name=muon", "optim.muon.weight_decay=-0.1"], "optim.muon.weight_decay"),
        (["optim.muon.weight_decay=0.1"], "optim.muon: set, but optim.name is adamw"),
        (["optim.name=adafactor", "optim.adafactor.decay_rate=0"], "optim.adafactor.decay_rate"),
        (["model.num_heads=3"], "model.num_heads"),
        (["model.num_kv_heads=3"], "model.num_kv_heads"),
        (
            ["train.global_batch_size=6", "train.gradient_accumulation_steps=4"],
            "gradient_accumulation_steps",
        ),
        (["mesh.data=-1", "mesh.tensor=-1"], "at most one size may be -1"),
        (["mesh.data=0"], "mesh.data"),
        (["distillation.alpha=1.5"], "distillation.alpha"),
        (["distillation.temperature=0"], "distillation.temperature"),
        (["distillation.beta=-1"], "distillation.beta"),
        (["distillation.balance=static"], "distillation.balance"),
        (["mesh.rules.batch=[data,data]"], "repeats a mesh axis"),
        (
            ["checkpoint.local_every_steps=10"],
            "checkpoint.local_every_steps is 10 but checkpoint.local_dir is not set",
        ),
        (["checkpoint.local_dir=gs://b/ckpt"], "checkpoint.local_dir: got 'gs://b/ckpt'; a gs://"),
        (["loss.vocab_chunk_size=100"], "loss.vocab_chunk_size"),
        (["loss.schedule=blocked"], "loss.schedule"),
        (
            ["loss.schedule=cpu_blocked", "loss.vocab_chunk_size=128"],
            "loss.schedule: cpu_blocked cuts rows of whole-vocabulary chunks",
        ),
        (
            ["loss.z_loss_multiplier=1e38"],
            "loss.z_loss_multiplier: got '1e38'; allowed: 0 <= z <= 1",
        ),
        (["loss.z_loss_multiplier=1.5"], "overflow float32"),
        (["model.vocab_size=2147483648"], "model.vocab_size"),
        (["train.steps=2147483648"], "train.steps"),
        (["train.seed=-1"], "train.seed"),
        (["data.seed=4294967296"], "data.seed"),
        (["distillation.layer_map=[[0,-1]]"], "layer -1 in [0, -1] is negative"),
        (["distributed.coordinator_address=host"], "distributed.coordinator_address"),
        *(
            (
                [f"train.hang_timeout_s={value}"],
                f"train.hang_timeout_s: got {shown}; allowed: a number of seconds >= 0 "
                "(0 = off), or auto",
            )
            for value, shown in (
                ("-1", "-1"),
                (".inf", "inf"),
                ("soon", "'soon'"),
                ("true", "True"),
            )
        ),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(tmp_path, overrides, message):
    cfg = write_config(tmp_path / "c.yaml", "mesh: {fsdp: 1}\n")
    with pytest.raises(KilnError, match=re.escape(message)):
        load_config(cfg, overrides)


def test_bounds_are_inclusive_where_they_say_so(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "mesh: {fsdp: 1}\n")
    c = load_config(cfg, ["loss.z_loss_multiplier=1", "train.seed=4294967295", "data.seed=0"])
    assert (c.loss.z_loss_multiplier, c.train.seed) == (1.0, 2**32 - 1)


def test_mesh_axes_rules_and_size_fields_are_one_declaration():
    assert MESH_AXES == ("stage", "data", "fsdp", "expert", "tensor", "sequence")
    assert list(MeshConfig.model_fields) == [*MESH_AXES, "rules"]
    (axis_literal,) = typing.get_args(
        typing.get_args(MeshConfig.model_fields["rules"].annotation)[1]
    )
    assert typing.get_args(axis_literal) == MESH_AXES


def test_every_problem_is_reported_at_once():
    raw = {
        "model": {"num_heads": 3},  # rule: does not divide d_model (and an odd head width)
        "data": {"seq_len": 4096},  # rule: longer than model.max_seq_len
        "optim": {"learning_rate": 0, "warmup_steps": 500},  # field; the warmup rule needs train
        "train": {"steps": "many", "run_name": "a/b"},  # two fields
        "loss": {"z_loss_multiplier": 2.0},  # field
        "bogus": {},  # unknown section
    }
    with pytest.raises(KilnError) as e:
        make_config(raw)
    lines = str(e.value).splitlines()
    assert len(lines) == 8, lines
    for field in (
        "optim.learning_rate: got 0",
        "train.steps: got 'many'",
        "train.run_name: got 'a/b'",
    ):
        assert sum(line.startswith(field) for line in lines) == 1, (field, lines)
    for start in ("loss.z_loss_multiplier: got 2.0", "unknown key 'bogus'", "model.num_heads: 3"):
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
    assert "model.head_dim: rotary embeddings need an even head width, got 85" in lines
    assert "data.seq_len: 4096 exceeds model.max_seq_len=2048" in lines
    # optim and train failed on their own fields, so the rule relating them is not guessed at.
    assert not any("warmup_steps" in line for line in lines)
    # Directly through the schema: every rule between fields, one line each.
    with pytest.raises(pydantic.ValidationError) as e:
        Config.model_validate({"model": {"num_heads": 3}, "data": {"seq_len": 4096}})
    assert "model.num_heads: 3" in str(e.value) and "data.seq_len: 4096" in str(e.value)


def test_mesh_rules_count_the_shards_each_dimension_really_gets():
    # batch [data, fsdp] claims fsdp first, so `length: [fsdp]` leaves the length whole and an
    # odd sequence length is fine; with batch on data only, length gets fsdp's 2 shards.
    # (The residual stream's length stays whole: `act_length: [sequence]`, no sequence parallelism.)
    sizes = {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1}
    base = {"data": {"seq_len": 15}, "train": {"global_batch_size": 8}}
    whole = {"act_length": ["sequence"]}
    make_config(base, mesh={**sizes, "rules": {**whole, "length": ["fsdp"]}})
    with pytest.raises(KilnError, match=r"data\.seq_len: 15 is not divisible by the 2 sequence"):
        make_config(base, mesh={**sizes, "rules": {**whole, "length": ["fsdp"], "batch": ["data"]}})
    # The logits' vocabulary gets tensor only when fsdp went to the batch: 384 / 2 per shard.
    vocab = {**whole, "vocab": ["tensor", "fsdp"]}
    config = make_config(base, mesh={**sizes, "rules": vocab}, loss={"vocab_chunk_size": 192})
    assert check_devices(config, 4) == {"stage": 1, **sizes, "expert": 1}
    with pytest.raises(KilnError, match=r"384 / 4 vocabulary shards"):
        make_config(
            base,
            mesh={**sizes, "rules": {**vocab, "batch": ["data"]}},
            loss={"vocab_chunk_size": 192},
        )


def test_sequence_parallel_residual_needs_seq_len_divisible_by_sequence_times_tensor():
    sizes = {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 2}
    # In order (load balance needs seq_len a multiple of 2 x 2, tests/test_attention.py).
    base = {
        "data": {"seq_len": 18},
        "train": {"global_batch_size": 8},
        "model": {"context_load_balance": False},
    }
    with pytest.raises(
        KilnError, match=r"data\.seq_len: 18 is not divisible by the 4 shards of the residual"
    ):
        make_config(base, mesh=sizes)
    make_config(base, mesh={**sizes, "rules": {"act_length": ["sequence"]}})
    make_config({**base, "data": {"seq_len": 20}}, mesh=sizes)


def test_tiling_must_divide_tokens_per_shard_batch_and_sequence():
    # micro-batch 8 / 4 accumulation = 2 sequences; over fsdp=2 shards: 1 sequence of 16 tokens.
    base = {
        "data": {"seq_len": 16},
        "train": {"global_batch_size": 8, "gradient_accumulation_steps": 4},
        "mesh": {"fsdp": 2},
    }
    Config.model_validate({**base, "loss": {"num_vocab_tiling": 16}})
    with pytest.raises(ValueError, match="16 tokens of one micro-batch on one shard"):
        Config.model_validate({**base, "loss": {"num_vocab_tiling": 32}})


def test_device_dependent_rules_are_checked_at_run_time():
    c = Config.model_validate(
        {"mesh": {"fsdp": -1, "tensor": 2}, "train": {"global_batch_size": 4}}
    )
    assert check_devices(c, 8) == {
        "stage": 1,
        "data": 1,
        "fsdp": 4,
        "expert": 1,
        "tensor": 2,
        "sequence": 1,
    }
    with pytest.raises(KilnError, match="batch shards"):
        check_devices(
            c.model_copy(update={"train": c.train.model_copy(update={"global_batch_size": 2})}), 8
        )
    fixed = Config.model_validate({"mesh": {"fsdp": 2, "tensor": 2}})
    with pytest.raises(KilnError, match="4 but 8 devices"):
        check_devices(fixed, 8)
    with pytest.raises(KilnError, match="whole number"):
        check_devices(Config.model_validate({"mesh": {"fsdp": -1, "tensor": 3}}), 8)


def test_schema_lists_every_field():
    rows = {r[0]: r for r in schema_rows()}

    def fields(prefix: str, model: type[pydantic.BaseModel]):
        for name, field in model.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
                yield from fields(f"{prefix}{name}.", kind)  # a subsection, e.g. optim.muon
            else:
                yield f"{prefix}{name}"

    for section, field in Config.model_fields.items():
        for dotted in fields(f"{section}.", field.annotation):
            assert dotted in rows, dotted
            assert rows[dotted][3], f"{dotted} has no description"
    assert "optim.muon.ns_steps" in rows
    assert math.isclose(float(rows["loss.z_loss_multiplier"][2]), 0.0)


# --- the CLI -------------------------------------------------------------------------------


def test_cli_bad_yaml_names_the_line(tmp_path):
    """By subprocess: the whole stderr of the `kiln config` process is the one error line (no
    start-up output, no traceback)."""
    cfg = write_config(tmp_path / "bad.yaml", "model:\n  d_model: 64\n  num_heads: [1, 2\n")
    assert_user_error(kiln("config", cfg), "line 4", "invalid YAML")


def test_cli_unknown_key_suggests(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "model: {d_modle: 64}\n")
    assert_user_error(kiln_main("config", cfg), "model.d_modle", "did you mean 'd_model'")


def test_cli_wrong_type(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "train: {steps: many}\n")
    assert_user_error(kiln_main("config", cfg), "train.steps", "'many'", "integer")


def test_cli_missing_file(tmp_path):
    assert_user_error(kiln_main("config", tmp_path / "nope.yaml"), "not found", "nope.yaml")


def test_cli_override_without_equals(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "{}\n")
    assert_user_error(kiln_main("config", cfg, "train.steps"), "KEY=VALUE")


def test_cli_failed_validation_creates_no_run_directory(tmp_path):
    """By subprocess: the `kiln train` process refuses with one line and no traceback."""
    cfg = write_config(tmp_path / "c.yaml", f"train: {{output_dir: {tmp_path / 'runs'}}}\n")
    proc = kiln("train", cfg, "loss.z_loss_multiplier=nan")
    assert_user_error(proc, "loss.z_loss_multiplier", "finite")
    assert not (tmp_path / "runs").exists()


def test_cli_config_prints_resolved_yaml(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "model: {d_model: 64}\n")
    proc = kiln_main("config", cfg, "loss.z_loss_multiplier=1e-4")
    assert proc.returncode == 0, proc.stderr
    assert "d_model: 64" in proc.stdout
    assert "z_loss_multiplier: 0.0001" in proc.stdout


def test_cli_schema_lists_every_field():
    proc = kiln_main("config", "--schema")
    assert proc.returncode == 0, proc.stderr
    for name, *_ in schema_rows():
        assert name in proc.stdout
    md = kiln_main("config", "--schema", "--format", "markdown")
    assert md.stdout.startswith("| field | type | default | description |")


def test_cli_reports_every_problem_of_a_file_one_line_each(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "model: {num_heads: 3}\ntrain: {steps: 0}\n")
    proc = kiln_main("config", cfg, "optim.learning_rate=-1")
    assert_user_error(
        proc, "model.num_heads: 3", "train.steps: got 0", "optim.learning_rate: got -1", lines=4
    )  # and model.head_dim (odd head width)


@pytest.mark.parametrize(
    "name", ["..", ".", "a/b", "/tmp/elsewhere", "../up", "x\\y"], ids=lambda n: repr(n)
)
def test_cli_run_name_is_one_path_component(tmp_path, name):
    cfg = write_config(tmp_path / "c.yaml", train={"output_dir": str(tmp_path / "runs")})
    proc = kiln_main("train", cfg, f"train.run_name={name}")
    assert_user_error(proc, f"train.run_name: got {name!r}", "single directory name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing written


def test_cli_local_dir_that_cannot_be_written_exits_2_before_anything_is_written(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", train={"output_dir": str(tmp_path / "runs")})
    (tmp_path / "file").write_text("")
    proc = kiln_main("train", cfg, f"checkpoint.local_dir={tmp_path / 'file' / 'local'}")
    assert_user_error(proc, "checkpoint.local_dir: ", f"{tmp_path / 'file'} is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "file"]  # nothing written


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("model.vocab_size=1000000000000", "model.vocab_size: got 1000000000000"),
        ("train.seed=99999999999999999999999", "train.seed: got 99999999999999999999999"),
        ("data.seed=-1", "data.seed: got -1"),
        ("loss.z_loss_multiplier=1e38", "overflow float32"),
        ("train.global_batch_size=4294967296", "train.global_batch_size"),
    ],
)
def test_cli_out_of_range_values_exit_2_with_one_line(tmp_path, override, needle):
    cfg = write_config(tmp_path / "c.yaml", "{}\n")
    assert_user_error(kiln_main("config", cfg, override), needle)


def test_a_stopped_run_exits_1_with_one_line_through_the_process_exit(
    tmp_path, monkeypatch, capsys
):
    from kiln import cli
    from kiln.errors import RunStopped
    from kiln.parallel import distributed
    from kiln.training import pretrain

    def stopped(config, restart=False, whole_process=False):
        raise RunStopped("3 consecutive steps had a non-finite loss or gradient")

    left = []
    monkeypatch.setattr(pretrain, "run", stopped)
    monkeypatch.setattr(distributed, "leave_if_joined", left.append)
    assert cli.main(["train", str(write_config(tmp_path / "c.yaml", "{}\n"))]) == 1
    assert capsys.readouterr().err == (
        "kiln: error: 3 consecutive steps had a non-finite loss or gradient\n"
    )
    assert left == [1]  # a process of a multi-process run leaves at once, with code 1


@pytest.mark.slow
def test_cli_run_whose_steps_all_go_non_finite_exits_1(tmp_path):
    # A learning rate of 1e30 leaves parameters of ~1e30 after step 1: step 2 overflows.
    cfg = write_config(
        tmp_path / "c.yaml",
        model={"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_seq_len": 8},
        data={"source": "synthetic", "seq_len": 8},
        optim={"learning_rate": 1e30, "schedule": "constant", "grad_clip": None},
        train={"steps": 3, "global_batch_size": 8, "max_consecutive_skips": 1,
               "output_dir": str(tmp_path / "runs")},
    )  # fmt: skip
    proc = kiln_main("train", cfg)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln: error: 1 consecutive steps had a non-finite loss"), last


def test_config_explain_names_the_file_override_or_default_of_each_value(tmp_path, capsys):
    from kiln.cli import main

    (tmp_path / "sub").mkdir()
    write_config(
        tmp_path / "base.yaml", "loss: {z_loss_multiplier: 1.0e-4}\nmodel: {d_model: 64}\n"
    )
    child = write_config(
        tmp_path / "sub" / "child.yaml",
        "base_config: ../base.yaml\nmodel: {d_model: 96, num_heads: 4}\n",
    )
    overrides = ["train.steps=7", "mesh.rules={act_length: [sequence]}"]
    assert main(["config", str(child), "--explain", *overrides]) == 0
    out = capsys.readouterr().out
    # Still the resolved config: the comments are YAML comments.
    assert yaml.safe_load(out) == load_config(child, overrides).model_dump(mode="json")
    origin = {}
    section = []
    for line in out.splitlines():
        text, _, note = line.partition("  # ")
        depth = (len(text) - len(text.lstrip())) // 2
        name = text.strip().split(":")[0]
        section = [*section[:depth], name]
        if note:
            origin[".".join(section)] = note
    base, child_name = str(tmp_path / "sub" / "../base.yaml"), str(child)
    assert origin["loss.z_loss_multiplier"] == f"{base} (default 0.0)"
    assert origin["model.d_model"] == f"{child_name} (default 256)"  # the child wins
    assert origin["model.num_heads"].startswith(child_name)
    assert origin["train.steps"] == "override train.steps=7 (default 100)"
    assert origin["mesh.rules.act_length"].startswith("override mesh.rules=")
    assert origin["mesh.rules.batch"] == "default"  # the rest of the rules: the schema's
    assert origin["loss.label_smoothing"] == "default"
    # What the README points at: tiny.yaml inherits base.yaml's z-loss, not the schema's 0.0.
    assert main(["config", str(REPO / "configs" / "tiny.yaml"), "--explain"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "z_loss_multiplier" in x)
    assert line.split("#")[1].strip() == f"{REPO / 'configs' / 'base.yaml'} (default 0.0)"


def test_a_closed_stdout_ends_kiln_quietly(tmp_path):
    """`kiln config --schema | head -1`: the reader goes away; no traceback, exit 141 (SIGPIPE)."""
    proc = start_kiln("config", "--schema", "--format", "markdown")
    proc.stdout.close()  # before kiln writes: every write finds the pipe closed
    _, err = communicate(proc)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
