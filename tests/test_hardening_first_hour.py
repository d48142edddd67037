"""A newcomer's first hour (issue #33, cases 14-18): what the README and docs lead a new user
to run, on a CPU machine with the development install (libtpu included)."""

import importlib.util
import os
import re
import sys
import types

import pytest

from conftest import REPO, assert_user_error, kiln, kiln_env, run_process
from kiln.config import load_config
from kiln.model import summary
from kiln.training.optim import make_optimizer, state_name
from kiln.util import platforms

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
TINY = REPO / "configs" / "tiny.yaml"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NARROW = ("model.num_layers=1", "model.d_model=32", "model.d_ff=64", "train.global_batch_size=8")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)


# Each row: a refusal after JAX has started, with JAX_PLATFORMS unset as in a user's shell
# (the suite sets it to cpu). libtpu, when installed, prints its own errors on a machine
# without a TPU if JAX starts its TPU backend: then stderr has more than kiln's one line.
@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        # The mesh needs 16 devices, 8 are present (conftest's simulated CPU devices): exit 2.
        ((TINY, "mesh.fsdp=16"), 2, "16 but 8 devices are present"),
        # The compiled peak over the budget, on the local devices: exit 1.
        ((TINY, "--hbm-gb", "0.0001"), 1, "exceeds --hbm-gb 0.0001"),
        # Compiling for a TPU slice loads libtpu on purpose, still with one line (a narrow
        # one-layer tiny.yaml: the TPU compiler's time is the model's, its messages are not).
        pytest.param(
            (TINY, *NARROW, "--topology", "v5p-8", "--hbm-gb", "0.0001"),
            1,
            "exceeds --hbm-gb 0.0001",
            marks=pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed"),
        ),
    ],
    ids=["refused-mesh", "over-budget", "topology"],
)
def test_a_cpu_machine_with_libtpu_installed_prints_only_kilns_line(args, code, needle, tmp_path):
    proc = kiln("compile", *args, cwd=tmp_path, env={"JAX_PLATFORMS": None})
    assert_user_error(proc, needle, code=code)
    assert list(tmp_path.iterdir()) == []


def test_jax_platforms_is_chosen_only_without_an_accelerator_or_a_users_choice(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(platforms, "TPU_DEVICE_FILES", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(platforms, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia0"),))
    environ: dict[str, str] = {}
    platforms.cpu_unless_attached(environ)
    assert environ == {"JAX_PLATFORMS": "cpu"}
    # The user's choice, even JAX's automatic one (empty), is kept.
    for chosen in ("", "tpu", "cuda,cpu"):
        environ = {"JAX_PLATFORMS": chosen}
        platforms.cpu_unless_attached(environ)
        assert environ == {"JAX_PLATFORMS": chosen}
    # A TPU chip (or a GPU) attached: JAX chooses, as it does without kiln.
    for device in ("accel0", "nvidia0"):
        (tmp_path / device).touch()
        environ = {}
        platforms.cpu_unless_attached(environ)
        assert environ == {}
        (tmp_path / device).unlink()


@pytest.mark.skipif(platforms.accelerator_attached(), reason="an accelerator: JAX chooses")
@pytest.mark.parametrize("imports", ["import kiln, jax", "import jax, kiln"])
def test_importing_kiln_on_a_cpu_machine_with_libtpu_installed_prints_nothing(imports, tmp_path):
    """The docs' Python snippets and benchmarks/*.py import kiln, before JAX or after it, with
    JAX_PLATFORMS unset: the process takes the CLI's choice, JAX's CPU backend, and an
    installed libtpu is not started (it would print its errors about the missing TPU)."""
    code = f"{imports}; print(jax.default_backend(), len(jax.devices()))"
    env = kiln_env(JAX_PLATFORMS=None)
    proc = run_process([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "cpu"
    assert proc.stderr == ""


def test_import_kiln_keeps_a_platform_chosen_in_the_environment_or_in_jaxs_config(
    tmp_path, monkeypatch
):
    """JAX imported first has read the environment already: the choice goes to its config too,
    unless it names a platform there."""
    monkeypatch.setattr(platforms, "TPU_DEVICE_FILES", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(platforms, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia0"),))
    config = types.SimpleNamespace(jax_platforms=None)
    config.update = lambda name, value: setattr(config, name, value)
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(config=config))
    monkeypatch.delenv("JAX_PLATFORMS")
    platforms.cpu_by_default()
    assert os.environ["JAX_PLATFORMS"] == "cpu" and config.jax_platforms == "cpu"
    # Chosen in JAX's config: kept there.
    monkeypatch.delenv("JAX_PLATFORMS")
    config.jax_platforms = "tpu"
    platforms.cpu_by_default()
    assert config.jax_platforms == "tpu"
    # Chosen in the environment (empty: JAX's automatic choice): nothing changes.
    for chosen in ("", "cuda"):
        monkeypatch.setenv("JAX_PLATFORMS", chosen)
        config.jax_platforms = None
        platforms.cpu_by_default()
        assert os.environ["JAX_PLATFORMS"] == chosen and config.jax_platforms is None


def test_the_summary_gives_the_state_in_the_gb_of_the_compiled_figures():
    """`kiln config --summary`'s state line is in decimal GB, as the compiled step and --hbm-gb
    below it are: 1,004,015,616 parameters x 4 bytes per device of the 8B config are 4.02 GB."""
    config = load_config(REPO / "configs" / "models" / "llama3-8b.yaml")
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim), 8)
    assert "GiB" not in text
    line = "params 4.02 GB + grads 4.02 GB + AdamW moments 8.03 GB = 16.06 GB (state, before"
    assert f"  {line} activations)" in text.splitlines()


def test_the_peak_buffers_sample_names_the_line_of_the_layer_scan():
    """docs/scaling.md's `--peak-buffers` sample: the stacked outputs are written at the layer
    scan of src/kiln/model/llama/layers.py (`scan_blocks`), and the source line it quotes is
    that call's line today (rerun the sample's command when the scan moves)."""
    source = (REPO / "src" / "kiln" / "model" / "llama" / "layers.py").read_text().splitlines()
    start = source.index(next(line for line in source if line.startswith("def scan_blocks(")))
    end = next(i for i in range(start + 1, len(source)) if source[i].startswith("def "))
    scans = [i + 1 for i in range(start, end) if "jax.lax.scan(" in source[i]]
    assert len(scans) == 1, scans
    quoted = re.findall(
        r"src/kiln/model/llama/layers\.py:(\d+)", (REPO / "docs/scaling.md").read_text()
    )
    assert quoted and set(map(int, quoted)) == set(scans), (quoted, scans)


# `kiln train configs/tiny.yaml ...` in a code block (`$ ` prompt or not) or a code span.
TINY_TRAIN = re.compile(
    r"^(?:\$ )?(kiln train configs/tiny\.yaml.*)$|`(kiln train configs/tiny\.yaml[^`]*)`", re.M
)


def test_every_changed_tiny_run_the_docs_show_has_a_run_name_of_its_own():
    """After the quickstart, runs/tiny is finished: a command that changes the config without
    naming a new run says `run complete` (or is refused) and trains nothing. Quoted refusals
    (the command followed by its `kiln: error:` line) are what they show."""
    for page in PAGES:
        text = page.read_text()
        for match in TINY_TRAIN.finditer(text):
            command = (match.group(1) or match.group(2)).split(" > ")[0].split("  #")[0]
            words = command.replace("\\\n", " ").split()
            overrides = [w for w in words[3:] if "=" in w]
            refused = text[match.end() : match.end() + 14] == "\nkiln: error: "
            if overrides and not refused:
                assert any("train.run_name=" in w for w in overrides), (page.name, command)


def test_the_docs_run_their_commands_in_the_environment_the_first_one_activates():
    """Later commands are bare (`kiln`, `tensorboard`): the README's first one activates .venv,
    and no page mixes in `.venv/bin/...`; a full-size model's summary names its devices."""
    first = SHELL_BLOCK.search((REPO / "README.md").read_text()).group(1)
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install")
    for page in PAGES:
        for block in SHELL_BLOCK.findall(page.read_text()):
            assert ".venv/bin/" not in block.replace(". .venv/bin/activate", ""), (page, block)
            for line in block.splitlines():
                if "--summary" in line and "configs/models/" in line:
                    # Without them its mesh.fsdp: -1 is this machine's devices (one CPU).
                    assert "--devices" in line or "mesh." in line, (page, line)
