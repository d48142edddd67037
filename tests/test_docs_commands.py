"""Every command in the fenced shell blocks of README.md and docs/**/*.md works as written.

Each page runs in a scratch copy of the repository's configs/ and scripts/, in order, after the
quickstart's first run (runs/tiny), as a reader who followed the quickstart would run it.
`kiln` commands run in this process with their step counts divided by STEP_SCALE (a config is
first validated as written, so a command that is wrong as written still fails), at most
NEW_TOKENS generated tokens per prompt, and evaluations that read every task as written but score
only its first rows (`few_rows`). Where a real run is beyond a test (several processes,
ahead-of-time compiles of 8B models, the scripts' kiln calls) the command line and its config are
validated instead (`docs_dry_kiln.py`); installs and other tools are only recognised. A block is
taken from a page when its language is one of SHELLS; a command with an ALL-CAPS placeholder
(RUN_DIR, CONFIG.yaml) is a synopsis and is skipped.
"""

import copy
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROGRAMS, REPO, communicate, kiln_env, shared
from kiln import cli
from kiln.commands import handlers as commands
from kiln.config import config_from_dict, load_config
from kiln.data.eval_tasks import ChoiceTask, PerplexityTask, parse_task, task_path

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Tools a page may name that the test does not run (installs, linters, servers, clusters); a
# `kiln` command inside `srun ...` or `--command="..."` is still checked. `.` activates the
# virtual environment.
EXTERNAL = {
    ".",
    "python3",
    "pip",
    "ruff",
    "pytest",
    "mkdocs",
    "tensorboard",
    "docker",
    "gcloud",
    "srun",
    "sbatch",
}
STEP_SCALE = 100
# Tokens `kiln generate` decodes per prompt at most: enough decode steps to run its loop.
NEW_TOKENS = 8
PLACEHOLDER = re.compile(r"\[?[A-Z][A-Z_]*(\.\.\.|\.yaml)?\]?\|?")
# Inputs a page assumes the reader has: created in the scratch directory before the page runs.
TEXT = "def f(x):\n    return x + 1\n"
FIXTURES = {
    "corpus/a.jsonl": (json.dumps({"text": TEXT}) + "\n") * 40,
    "data/train.jsonl": (json.dumps({"text": TEXT}) + "\n") * 40,
}
# Runs that pages compare, made by scripts/zloss_ab.sh (whose kiln calls are only validated).
SEEDED_RUNS = ("experiments/zloss_ab/zloss_off.yaml", "experiments/zloss_ab/zloss_1e-4.yaml")
# Directories a page names as the reader's own: linked to what an earlier command wrote.
STAND_INS = {"path/to/llama": "exported/tiny"}
# Files a page expects the user to have written (its text shows their format).
USER_FILES = {
    "prompts.jsonl": '{"prompt": "def main("}\n{"prompt": "import "}\n',
    "data/wiki.jsonl": '{"text": "A kiln is a thermally insulated chamber."}\n' * 40,
}


def shell_commands(page: Path) -> list[list[str]]:
    """The commands of a page's shell blocks, in order: continuations joined, `&&` split."""
    out = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang not in SHELLS:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(words[:cut])
                words = words[cut + 1 :]
    return out


def named_files(page: Path) -> dict[str, str]:
    """YAML blocks whose first line names their file (`# finetune.yaml`)."""
    files = {}
    for lang, body in FENCE.findall(page.read_text()):
        first = body.splitlines()[0] if body else ""
        if lang == "yaml" and re.fullmatch(r"# [\w./-]+\.yaml", first):
            files[first[2:]] = body
    return files


def is_synopsis(words: list[str]) -> bool:
    return any(PLACEHOLDER.fullmatch(w) or w.startswith("[") for w in words[1:])


def scaled(config, cache: Path, evaluate: bool = False):
    """The config with step counts / STEP_SCALE, the data cache (`cache`) every page shares and
    the test run's compilation cache;
    `evaluate`: one evaluation (held-out loss and tasks) at the end, else none."""
    raw = config.model_dump(mode="json")
    t, o, c = raw["train"], raw["optim"], raw["checkpoint"]
    down = lambda n: n and max(1, math.ceil(n / STEP_SCALE))  # noqa: E731 - 0 stays 0
    t["steps"] = down(t["steps"])
    t["log_every_steps"] = down(t["log_every_steps"])
    # Not a step count a command depends on; evaluating saves nothing but an eval compile, so
    # only the seeded runs (whose eval figures pages draw) evaluate, once.
    t["eval_every_steps"] = t["steps"] if evaluate and t["eval_every_steps"] else 0
    t["eval_batches"] = 1
    if t["eval_every_steps"]:
        t["eval_tasks"] = [few_questions(task, cache) for task in t["eval_tasks"]]
    o["warmup_steps"] = min(down(o["warmup_steps"]), t["steps"])
    c["every_steps"] = down(c["every_steps"])
    t["compilation_cache_dir"] = str(PROGRAMS)
    if raw["data"]["source"] != "tokens":
        raw["data"]["cache_dir"] = str(cache / "data")
    return config_from_dict(raw)


# Questions of a multiple-choice task a seeded run or `kiln eval` scores: pages draw its
# metrics by name (eval/<task>/acc_norm), not their values.
CHOICE_QUESTIONS = 8


def few_questions(text: str, cache: Path) -> str:
    """A `choice` task string for the first CHOICE_QUESTIONS questions of its file, under the
    task's own name; other tasks as given."""
    spec = parse_task(text)
    if spec.kind != "choice":
        return text
    lines = Path(task_path(spec)).read_text().splitlines(keepends=True)[:CHOICE_QUESTIONS]
    path = cache / "choice" / f"{spec.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return f"{spec.name}=choice:{path}"


def few_rows(tasks: list, batch_size: int) -> list:
    """`kiln eval`'s tasks, read and tokenized whole, cut to what it scores here: a choice task's
    first CHOICE_QUESTIONS questions, one batch of a perplexity task's windows."""
    out = []
    for task in tasks:
        if isinstance(task, ChoiceTask):
            rows = int(task.num_choices[:CHOICE_QUESTIONS].sum())
            task = dataclasses.replace(
                task,
                gold=task.gold[:CHOICE_QUESTIONS],
                num_choices=task.num_choices[:CHOICE_QUESTIONS],
                choice_bytes=task.choice_bytes[:CHOICE_QUESTIONS],
                rows=task.rows[:rows],
                targets_from=task.targets_from[:rows],
            )
        elif isinstance(task, PerplexityTask):
            windows = copy.copy(task.windows)
            windows.num_windows = min(windows.num_windows, batch_size)
            task = dataclasses.replace(task, windows=windows)
        out.append(task)
    return out


def dry(args) -> bool:
    """Whether a kiln command is validated instead of run."""
    if args.command == "compile" or (args.command == "config" and args.summary):
        return True
    if args.command in ("train", "distill"):
        d = load_config(args.config, args.overrides).distributed
        return d.num_processes > 1 or d.auto
    return False


def run_kiln(argv: list[str], later: str, cache: Path, capsys) -> None:
    """A kiln command in this process; a training whose run no later command of the page
    (`later`) names is only started up to its checks (config, run directory, data, teacher)."""
    if "--step" in argv:  # a checkpoint step of a scaled run
        i = argv.index("--step") + 1
        argv = [*argv[:i], str(math.ceil(int(argv[i]) / STEP_SCALE)), *argv[i + 1 :]]
    args = cli.parse_args(argv)
    if args.command == "generate":  # the last --max-new-tokens counts
        argv = [*argv, "--max-new-tokens", str(min(args.max_new_tokens, NEW_TOKENS))]
    if dry(args):
        load_config(args.config, args.overrides)
        return
    if args.command in ("train", "distill"):
        config = scaled(load_config(args.config, args.overrides), cache)
        if str(config.run_dir) not in later:
            start_checks(config, args)
            return
    capsys.readouterr()
    code = cli.main(argv)
    assert code == 0, capsys.readouterr().err[-3000:]


def start_checks(config, args) -> None:
    """What `kiln train`/`kiln distill` checks before its first step, without the training."""
    from kiln.data import make_datasets
    from kiln.distill.teacher import read_teacher_config
    from kiln.runs.rundir import RunComplete
    from kiln.training.runner import resume_notes

    if args.command == "distill":
        read_teacher_config(config)
    try:
        resume_notes(config, args.restart)
    except RunComplete:
        return
    make_datasets(config)


def run_script(words: list[str], scratch: Path) -> None:
    env = kiln_env(PATH="/usr/bin:/bin")
    env.pop("PYTHON", None)
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(
        words, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = communicate(proc)
    finally:
        if proc.poll() is None:  # the script's processes too, not only the script
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]


def run_command(words: list[str], later: str, scratch: Path, cache: Path, capsys) -> None:
    prog = words[0].removeprefix(".venv/bin/")
    for name, target in STAND_INS.items():
        if name in words and not (scratch / name).exists():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).symlink_to(scratch / target)
    for name, text in USER_FILES.items():
        if any(name in w for w in words) and not (scratch / name).exists():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_text(text)
    if prog == "kiln":
        run_kiln(words[1:], later, cache, capsys)
    elif prog.startswith("scripts/"):
        run_script(words, scratch)
    elif prog in EXTERNAL:
        inner = [w.removeprefix("--command=") for w in words if w.startswith("--command=")]
        inner = (
            shlex.split(inner[0])
            if inner
            else words[words.index("kiln") :]
            if "kiln" in words
            else []
        )
        if inner:
            run_kiln(inner[1:], later, cache, capsys)
    else:
        raise AssertionError(f"the docs test does not know the command {prog!r}: teach it")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """A scratch repository after the quickstart's first command (runs/tiny trained) and the
    README's z-loss A/B (its two runs); made once per test run, beside the caches (`cache`)
    every page shares."""
    return shared(tmp_path_factory, "quickstart", make_quickstart) / "repo"


def make_quickstart(path: Path) -> None:
    root = path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    shutil.copytree(REPO / "scripts", root / "scripts")
    python = root / ".venv" / "bin" / "python"  # what the scripts find: validates their kiln calls
    python.parent.mkdir(parents=True)
    dry_kiln = Path(__file__).with_name("docs_dry_kiln.py")
    python.write_text(
        "#!/bin/bash\n"
        'args=("$@")\n'
        "for ((i = 0; i + 1 < ${#args[@]}; i++)); do\n"
        "  if [[ ${args[i]} == -m && ${args[i+1]} == kiln.cli ]]; then\n"
        f'    exec {sys.executable} {dry_kiln} "${{args[@]:i+2}}"\n'
        "  fi\n"
        "done\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        cache = path / "cache"
        mp.setattr(
            commands, "_load", lambda a: scaled(load_config(a.config, a.overrides), cache, True)
        )
        for config in ("tiny.yaml", *SEEDED_RUNS):
            assert cli.main(["train", f"configs/{config}"]) == 0


def scale_cli(mp: pytest.MonkeyPatch, cache: Path) -> None:
    """`kiln` commands of this process load configs as written, then scale them; `kiln eval`
    scores `few_rows` of its tasks."""
    mp.setattr(
        commands, "_load", lambda args: scaled(load_config(args.config, args.overrides), cache)
    )
    from kiln.commands import evaluate  # imported by the first page that needs it

    load_tasks = evaluate.load_tasks
    mp.setattr(
        evaluate,
        "load_tasks",
        lambda specs, config, tok: few_rows(
            load_tasks(specs, config, tok), config.train.global_batch_size
        ),
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_of_the_page_works(page, quickstart, tmp_path, monkeypatch, capsys):
    commands = [w for w in shell_commands(page) if not is_synopsis(w)]
    if not commands:
        pytest.skip("no commands")
    scratch = tmp_path / "repo"
    shutil.copytree(quickstart, scratch, symlinks=True)
    for name, text in {**FIXTURES, **named_files(page)}.items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)
    monkeypatch.chdir(scratch)
    scale_cli(monkeypatch, quickstart.parent / "cache")
    for i, words in enumerate(commands):
        later = " ".join(" ".join(w) for w in commands[i + 1 :])
        later += " ".join(named_files(page).values())
        try:
            run_command(words, later, scratch, quickstart.parent / "cache", capsys)
        except (AssertionError, SystemExit, Exception) as e:
            raise AssertionError(f"{page.name}: `{shlex.join(words)}` fails: {e}") from e


@pytest.mark.parametrize("script", ["launch_local.sh", "zloss_ab.sh"])
def test_a_script_without_kiln_says_how_to_get_it(script, tmp_path):
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    python = tmp_path / "bin" / "python3"  # the only python on PATH: one without kiln
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')  # no PYTHONPATH, no site
    python.chmod(0o755)
    env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    args = ["2", "configs/tiny.yaml"] if script == "launch_local.sh" else []
    proc = subprocess.run(
        [tmp_path / "scripts" / script, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import kiln" in lines[0] and ".venv" in lines[0], lines
    assert "PYTHON=" in lines[0]
