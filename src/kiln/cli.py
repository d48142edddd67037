"""The `kiln` command: argument parsing and exit codes only; what each command does is in
kiln.commands, which calls the run functions."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

import kiln  # the platform choice (kiln/__init__.py), made before any command imports JAX
from kiln.commands.handlers import (
    cmd_compare,
    cmd_compile,
    cmd_config,
    cmd_distill,
    cmd_eval,
    cmd_export_hf,
    cmd_generate,
    cmd_import_hf,
    cmd_prepare,
    cmd_teacher_logits,
    cmd_train,
)
from kiln.errors import KilnError, RunStopped
from kiln.util.interrupt import exit_code, exit_on_signals, signal_of, stop_line


class _HelpFormatter(argparse.HelpFormatter):
    """`--help` names each option's default, unless its help already does or it has none
    (None, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if not action.option_strings or unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line, like every other error (`--help` shows the usage)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kiln: error: {message} (see `{self.prog} --help`)\n")


def _at_least(low: int):
    """argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer >= {low}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a number > 0")
    return value


def _add_config_args(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    p.add_argument("config", nargs="?" if optional else None, help="YAML config file")
    # default=[]: argparse would otherwise list an empty `overrides` as a missing argument.
    p.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="dotted overrides, e.g. loss.z_loss_multiplier=1e-4",
    )


def _add_restart_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--restart",
        action="store_true",
        help="start the run over from step 0; its earlier files move to RUN_DIR/restart-N/",
    )


def _add_device_args(p: argparse.ArgumentParser) -> None:
    """--devices, --topology and --hbm-gb of `kiln compile` and `kiln config --summary`."""
    p.add_argument(
        "--devices", type=_at_least(1), default=None, metavar="N", help="N simulated CPU devices"
    )
    p.add_argument(
        "--topology",
        default=None,
        metavar="NAME",
        help="a TPU slice, e.g. v5p-8, v5e-16, v6e-8 (libtpu's compiler; pip install 'kiln[tpu]')",
    )
    p.add_argument(
        "--hbm-gb",
        type=_positive_float,
        default=None,
        metavar="X",
        help="memory per device in GB (1e9 bytes): the compiled peak is checked against it",
    )


def version() -> str:
    """kiln's version and the versions of the libraries a run's numbers depend on."""
    pinned = []
    for name in ("jax", "flax", "optax", "orbax-checkpoint"):
        try:
            pinned.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(f"{name} not installed")
    return f"kiln {kiln.__version__} ({', '.join(pinned)})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kiln", description="LLM pre-training and distillation on JAX.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train from a YAML config (resumes the run if it exists)")
    _add_config_args(p)
    _add_restart_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "distill",
        help="distil a teacher run (distillation.teacher_run_dir) into the configured student",
    )
    _add_config_args(p)
    _add_restart_arg(p)
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser(
        "teacher-logits",
        help="store a teacher's top-k logits over the config's training stream (offline distill)",
    )
    _add_config_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="store directory (resumes it)")
    p.add_argument(
        "--top-k", type=_at_least(1), default=64, metavar="K", help="logits kept per token"
    )
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="of stored values"
    )
    p.add_argument(
        "--shard-steps",
        type=_at_least(1),
        default=None,
        metavar="N",
        help="steps per shard (default: about 256 MB per shard and process)",
    )
    p.set_defaults(func=cmd_teacher_logits)

    p = sub.add_parser("config", help="print the resolved config, its summary, or the schema")
    _add_config_args(p, optional=True)
    p.add_argument(
        "--schema", action="store_true", help="list every field with type, default, description"
    )
    p.add_argument(
        "--format", choices=("text", "markdown"), default="text", help="format of --schema"
    )
    p.add_argument(
        "--summary",
        action="store_true",
        help="parameters, FLOPs per token, memory per device (state, and compiled activations)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="the resolved config with, on each value, the file, override or default that set it",
    )
    _add_device_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "compile",
        help="compile the train step ahead of time: memory, FLOPs, collectives (allocates nothing)",
    )
    _add_config_args(p)
    _add_device_args(p)
    p.add_argument(
        "--fit",
        action="store_true",
        help="search remat, vocab tiling and accumulation for settings that fit --hbm-gb",
    )
    p.add_argument(
        "--fit-mesh",
        default=None,
        metavar="AXES",
        help="with --fit, also search the splits of the devices over these mesh axes "
        "(comma-separated among stage,data,fsdp,expert,tensor,sequence; with stage, also "
        "pipeline.repeats on each stage count)",
    )
    p.add_argument(
        "--peak-buffers",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="also list the N largest buffers live at the step's peak memory, with the JAX op "
        "that made each (from XLA's buffer assignment; 0: off)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("prepare", help="tokenize text, JSONL or Parquet files into token shards")
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="GLOB",
        help="input files, directories or globs (quote globs), local or URLs (gs://, s3://, hf://, "
        "file://); stdlib:GLOB = the Python stdlib",
    )
    p.add_argument(
        "--format", choices=("text", "jsonl", "parquet"), required=True, help="of the input files"
    )
    p.add_argument("--field", default="text", help="JSONL/Parquet field holding the text")
    p.add_argument(
        "--tokenizer", default="byte", help="'byte', a tokenizer.json or a sentencepiece .model"
    )
    p.add_argument(
        "--output", required=True, metavar="DIR", help="directory (or URL) of the shards"
    )
    p.add_argument(
        "--workers",
        type=_at_least(1),
        default=None,
        help="parallel workers (default: every core; one for inputs under 8 MB)",
    )
    p.add_argument(
        "--on-decode-error",
        choices=("error", "skip", "replace"),
        default="error",
        help="a text file or JSONL line that is not UTF-8: stop (default), leave it out, or "
        "replace its invalid bytes (the counts are printed)",
    )
    p.add_argument(
        "--record-format",
        choices=("text", "chat", "prompt_completion"),
        default="text",
        help="JSONL records: text (--field), chat (messages; only assistant turns get loss "
        "weight 1) or prompt_completion (only the completion does); as data.format",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file for --record-format chat (default: the chat_template "
        "of the tokenizer_config.json next to --tokenizer; a built-in one for byte)",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "compare", help="plot metrics of several runs: one panel per metric, one line per run"
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories ({output_dir}/{run_name})"
    )
    p.add_argument(
        "--metrics",
        default="learning/loss",
        help="comma-separated tags, one panel each; '*' matches any text, e.g. 'eval/loss/*' "
        "(each source of a mixture) (default: learning/loss)",
    )
    p.add_argument("--out", required=True, metavar="FILE.png", help="image to write")
    p.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="K",
        help="trailing moving average over the last K logged points (default 1: raw)",
    )
    p.add_argument("--log-scale", action="store_true", help="logarithmic y axes")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "export-hf",
        help="write a run's checkpoint as a Hugging Face model directory (Llama, Qwen3, Qwen3-MoE, Mixtral)",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory ({output_dir}/{run_name})")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, metavar="DIR", help="new directory to write")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("generate", help="continue prompts with a run's model (KV-cache decoding)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory ({output_dir}/{run_name})")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--prompt", default=None, metavar="TEXT", help="one prompt")
    p.add_argument(
        "--prompts", default=None, metavar="FILE.jsonl", help='one {"prompt": "..."} per line'
    )
    p.add_argument(
        "--max-new-tokens", type=_at_least(1), default=128, metavar="N", help="tokens per prompt"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    p.add_argument(
        "--top-k",
        type=_at_least(1),
        default=None,
        metavar="K",
        help="sample among the K likeliest",
    )
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus mass, (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument(
        "--num-samples", type=_at_least(1), default=1, metavar="N", help="samples per prompt"
    )
    p.add_argument("--stop", default=None, metavar="STRING", help="end a completion at this string")
    p.add_argument(
        "--out", default=None, metavar="FILE.jsonl", help="write JSONL records instead of text"
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "eval", help="score a run's checkpoint on tasks: perplexity and multiple choice"
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory ({output_dir}/{run_name})")
    p.add_argument(
        "tasks",
        nargs="+",
        metavar="TASK",
        help="[NAME=]perplexity:PATH (text/JSONL/Parquet files, stdlib:GLOB) or "
        "[NAME=]choice:FILE.jsonl; kiln:FILE is a task shipped with kiln",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument(
        "--out", default=None, metavar="FILE", help="report to write (default: RUN_DIR/eval.json)"
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log eval/<task>/<metric> at the checkpoint's step into RUN_DIR/tensorboard",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "import-hf",
        help="turn a local Hugging Face model directory (Llama, Qwen3, Qwen3-MoE, Mixtral) into a kiln run",
    )
    p.add_argument("hf_dir", metavar="DIR", help="config.json + model.safetensors (or shards)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="new run directory to write")
    p.set_defaults(func=cmd_import_hf)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; usage mistakes exit 2 with one line."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides after an option (`kiln train C.yaml --restart a.b=c`): argparse stops collecting
    # the positional list at the option; anything else unknown is still refused.
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:  # a Ctrl-C while the arguments are read is one line too
        args = parse_args(argv)
        # The process is this command's own (not a caller's that runs `main` as a function): a
        # run counts its start-up from the process's start, and ends the process when it is done.
        args.whole_process = argv is None
        # Every command: one line and an immediate exit on a signal (a run's loop takes the
        # signals over to checkpoint first, `kiln prepare` to stop its workers); what commands
        # write is renamed into place whole or removed on the way out (kiln.util.interrupt).
        with exit_on_signals():
            code = args.func(args)
        if args.whole_process and args.func in (cmd_train, cmd_distill):
            _end_run_process(code)
        return code
    except (KilnError, RunStopped) as e:
        if os.environ.get("KILN_DEBUG") == "1":
            raise
        # One line per problem: bad input exits 2, a run that cannot go on exits 1.
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"kiln: error: {line}", file=sys.stderr)
        return _leave(2 if isinstance(e, KilnError) else 1)
    except KeyboardInterrupt as e:
        signum = signal_of(e)  # raised inside kiln prepare's work (signals_as_interrupt)
        print(stop_line(signum), file=sys.stderr)
        return _leave(exit_code(signum))
    except BrokenPipeError:
        # The reader of stdout has gone (`kiln config --explain | head`): stop quietly, as a
        # Unix filter does; stdout goes to /dev/null so that the exit's flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _leave(141)


def _end_run_process(code: int) -> None:
    """End the `kiln` process of a finished run at once: its files are closed and its uploads
    done, and the interpreter's teardown (XLA's clients, a large module graph: about a second)
    would be wall time that no goodput figure of the run counts. Not in a process of a
    multi-process run: it waits at JAX's shutdown for the others, whose coordinator may be in it."""
    distributed = sys.modules.get("kiln.parallel.distributed")
    if distributed is not None and distributed.joined():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave(code: int) -> int:
    """The exit code; a process of a multi-process run exits at once (see kiln.parallel.distributed)."""
    distributed = sys.modules.get("kiln.parallel.distributed")  # only loaded by the run functions
    if distributed is not None:
        distributed.leave_if_joined(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
