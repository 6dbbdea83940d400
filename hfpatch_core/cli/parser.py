"""The ``hfpatch`` argument parser and the dispatch of every command but ``run``'s fast path."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from .._session.announcement import silenced
from ..settings import AUTORUN_MODULE, LOCK_FILE
from .exit_codes import EXIT_BROKEN_PIPE, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from .output import UsageError, show_warning, without_progress_bars


def cmd_run(args: argparse.Namespace) -> int:
    from .launch import LaunchError, launch

    try:
        launch(args.command)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(args.model, args.packs)
    return EXIT_OK if report is None or report.ok else EXIT_PROBLEMS


def cmd_new(args: argparse.Namespace) -> int:
    from .scaffold import new_pack

    try:
        project = new_pack(
            args.name,
            model_type=args.model_type,
            target=args.target,
            structural=args.structural,
            no_input=args.no_input,
            output_dir=args.output_dir,
        )
    except EOFError:
        print()
        raise UsageError("standard input ended before every question was answered; pass --no-input") from None
    relative = os.path.relpath(project)
    shown = str(project) if relative.startswith("..") else relative
    print(f"Created {shown}. Next:")
    print(f"  cd {shown}")
    print('  pip install -e ".[test]"   # the pack, hfpatch-core, transformers, torch and pytest')
    print("                             # (hfpatch-core not on your index: add --find-links, see README.md)")
    print("  pytest                     # the generated equivalence test")
    return EXIT_OK


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``hfpatch_core.cli.<module>``, imported when it runs: a command's
    module imports torch and transformers, and ``hfpatch list`` must not."""

    def handler(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(f".{module}", __package__), name)
        return command(args)

    return handler


def version_text() -> str:
    """What ``hfpatch --version`` prints: hfpatch-core's version, transformers' and every installed
    pack's, from the distributions' metadata (nothing imported)."""
    import importlib_metadata

    from .._pipeline.discovery import discover
    from .output import transformers_version

    try:
        core = str(importlib_metadata.version("hfpatch-core"))
    except importlib_metadata.PackageNotFoundError:  # a source tree on the path
        from .. import __version__ as core
    discovery = discover()
    infos = [*discovery.packs.values(), *(info for infos in discovery.duplicates.values() for info in infos)]
    packs = ", ".join(
        f"{info.name} {info.version} ({info.distribution})" for info in sorted(infos, key=lambda i: i.name)
    )
    return f"hfpatch-core {core}\ntransformers {transformers_version()}\npacks: {packs or 'none installed'}"


class _Version(argparse.Action):
    """``--version``: the versions are read when asked for, not every time the parser is built."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="show hfpatch-core's, transformers' and the packs' versions"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(version_text())
        parser.exit(EXIT_OK)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfpatch",
        description="List, explain, check and run 🤗 Transformers patch packs.",
        epilog="Exit codes: 0 ok, 1 problems found, 2 bad input. HF_PATCH_PACKS chooses the packs.",
    )
    parser.add_argument("--version", action=_Version)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="compute what list, lock, lock --check and verify --all-model-types keep in the cache "
        "(HF_PATCH_CACHE) again, and keep nothing",
    )
    commands = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="installed packs and whether they are enabled")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument(
        "--no-conflicts",
        action="store_true",
        help="read metadata only: do not import the enabled packs to find the model types they conflict on",
    )
    listing.set_defaults(handler=_lazy("listing", "cmd_list"))

    explaining = commands.add_parser("explain", help="what the enabled packs would replace in a model")
    explaining.add_argument("model", help="a local checkpoint directory or a model_type")
    explaining.add_argument("--json", action="store_true", help="machine-readable output")
    explaining.set_defaults(handler=_lazy("explain", "cmd_explain"))

    checking = commands.add_parser("check", help="import packs and validate what their hooks return")
    checking.add_argument(
        "packs",
        nargs="*",
        metavar="PACK",
        help="packs to check, with @N priority offsets as in HF_PATCH_PACKS (default: the packs HF_PATCH_PACKS "
        "selects, as for a load)",
    )
    checking.add_argument(
        "--model-type",
        action="append",
        metavar="TYPE",
        help="check on these model types (repeatable) instead of those the pack targets (what it answers "
        "without a config, declares, or, for a pack that decides from the config, answers with a tiny config "
        "of each model type: kept in HF_PATCH_CACHE)",
    )
    checking.add_argument(
        "--record",
        action="store_true",
        help="add the installed transformers release to each passing pack's drift record (beside its module)",
    )
    checking.set_defaults(handler=_lazy("check", "cmd_check"))

    verifying = commands.add_parser("verify", help="prove packs keep models correct on tiny checkpoints")
    verifying.add_argument(
        "packs",
        nargs="*",
        metavar="PACK",
        help="packs to verify (default: those HF_PATCH_PACKS selects; every installed pack when it is unset)",
    )
    verifying.add_argument("--model-type", action="append", help="model types to verify on (repeatable)")
    verifying.add_argument("--model", help="a local checkpoint directory to verify on")
    verifying.add_argument(
        "--all-model-types",
        action="store_true",
        help="verify on a tiny checkpoint of every causal-LM and image-text-to-text model type (or of each "
        "--model-type): one verdict each "
        "(exact, failed, refused, not applicable, no checkpoint), the coverage table of docs/zoo.md; one checkpoint "
        "per model type for every pack, verdicts kept in the cache until a version changes",
    )
    verifying.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="with --all-model-types: verify in N worker processes (1: in this process; default 2 from 8 model "
        "types on, where a worker's start costs less than it saves)",
    )
    verifying.add_argument("--json", action="store_true", help="machine-readable output")
    verifying.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="load both models in this dtype (default float32); below float32 the logits bound is calibrated in the "
        "run: a multiple of what the dtype does to the vanilla model",
    )
    verifying.add_argument(
        "--distributed",
        metavar="MODES",
        help="also shard as transformers does on 2 local ranks (torchrun, gloo): tp,fsdp,ep",
    )
    verifying.add_argument(
        "--train",
        dest="train_steps",
        action="store_const",
        const=5,
        default=0,
        help="also train with and without each pack for 5 AdamW steps and compare losses, gradients and weights",
    )
    verifying.set_defaults(handler=_lazy("verify", "cmd_verify"))

    locking = commands.add_parser(
        "lock",
        help="write the packs and plans of this environment to a lock file, or check the environment against one",
        description="Write the selected packs (name, distribution, version, a hash of their installed files) and the "
        "plan of every model type they target. With HF_PATCH_LOCK=FILE every load compares its packs and plan "
        "with FILE before reading a weight, and raises LockError on a difference.",
    )
    locking.add_argument(
        "-o", "--output", default=LOCK_FILE, metavar="FILE", help=f"the lock file to write (default: {LOCK_FILE})"
    )
    locking.add_argument(
        "--check",
        metavar="FILE",
        help="compare this environment with the lock FILE instead of writing one: exit 0 if it matches, "
        "1 with the differences",
    )
    locking.add_argument(
        "--model-type",
        action="append",
        metavar="TYPE",
        help="also lock this model type's plan (repeatable); those the packs target are always locked",
    )
    locking.add_argument(
        "--model",
        action="append",
        metavar="DIR",
        help="lock its model type's plan as this checkpoint's config makes it, not the default config (repeatable)",
    )
    locking.set_defaults(handler=_lazy("lock", "cmd_lock"))

    demo = commands.add_parser("demo", help="load a tiny model with and without packs and compare")
    demo.add_argument("--model", help="a local checkpoint directory (default: a tiny random Qwen2-MoE)")
    demo.add_argument(
        "--packs",
        metavar="SPEC",
        help="the packs, as HF_PATCH_PACKS writes them (default: HF_PATCH_PACKS; when it is unset, qwen-moe, "
        "else the built-in example)",
    )
    demo.set_defaults(handler=cmd_demo)

    creating = commands.add_parser("new", help="create a pack project from the template")
    creating.add_argument("name", nargs="?", help="the pack's name, what HF_PATCH_PACKS selects (default: my-pack)")
    creating.add_argument(
        "--model-type", metavar="TYPE", help="config.model_type the example patch applies to (default: llama)"
    )
    creating.add_argument(
        "--target", metavar="CLASS", help="the transformers class to replace (default: the model type's MLP class)"
    )
    creating.add_argument(
        "--structural",
        action="store_true",
        help="start from the structural example (docs/examples/rms-norm): classes found by what they compute",
    )
    creating.add_argument("--no-input", action="store_true", help="ask nothing: use the values given and the defaults")
    creating.add_argument(
        "-o", "--output-dir", default=".", metavar="DIR", help="where to create the project (default: .)"
    )
    creating.set_defaults(handler=cmd_new)

    running = commands.add_parser(
        "run",
        help="run a program (and its children) with hfpatch enabled",
        description="Run CMD with hfpatch enabled in it and in every Python process it starts. "
        "'python' or 'python3' as CMD is this environment's interpreter (" + sys.executable + "), not the "
        "first Python on PATH; in a virtual environment, CMD's PATH starts with the environment's scripts "
        "directory, as if it were activated, so 'python' and 'hfpatch' in CMD's children are this environment's.",
        usage="hfpatch run -- CMD [ARG ...]",
    )
    running.add_argument("command", nargs=argparse.REMAINDER, help="-- program and arguments")
    running.set_defaults(handler=cmd_run)
    return parser


#: The commands that load models: transformers' progress bars are off while they run (``lock``
#: builds no model, and a ``lock --check`` answered from the cache must not import transformers).
_LOADING_COMMANDS = frozenset({"verify", "demo", "explain"})


def main(argv: Sequence[str] | None = None) -> int:
    # a command plans and loads with the packs it is asked about, vanilla where it compares: never under
    # the process-wide enable that a selection in its environment starts at the first load (_hfpatch_autorun)
    autorun = sys.modules.get(AUTORUN_MODULE)
    if autorun is not None and hasattr(autorun, "settle"):
        autorun.settle(enable=False)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.no_cache:
            from . import cache

            cache.disabled = True
        # before any command imports torch, transformers or a pack: bad input is reported in a moment
        from .inputs import check_input

        check_input(args)
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            # installed here, by the command, never on import: a program using the library keeps its own
            warnings.showwarning = show_warning
            # the command reports what the packs did: not the line a program's first patched load prints
            stack.enter_context(silenced())
            if args.command_name in _LOADING_COMMANDS:
                stack.enter_context(without_progress_bars())
            code: int = args.handler(args)
        sys.stdout.flush()  # here, so that a reader gone away is caught below and not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # what is left to write goes nowhere, quietly, as for a program killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        from ..errors import HfPatchError

        if args.debug:
            raise
        if isinstance(exc, UsageError | HfPatchError | OSError | ValueError):
            print(f"hfpatch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"hfpatch: error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_PROBLEMS
