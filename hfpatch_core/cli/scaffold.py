"""``hfpatch new``: generate a patch-pack project from the cookiecutter template.

The template ships inside the package (``hfpatch_core/_template``); in a source checkout
it is ``cookiecutter-template/`` next to the package.  Its ``pre_gen_project`` hook checks
the answers (pack and module names, model type, target class, transformers range) and
``new_pack`` turns a rejection into one ``ScaffoldError``.  The project is
generated in a hidden staging directory inside ``output_dir`` and moved into place only
when it is complete, so a failure leaves nothing behind.

cookiecutter is imported on first use; the template's hook and filters import transformers
in the process that renders them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import HfPatchError

#: Where the template lives inside the installed package (hatch ``force-include``).
PACKAGED_TEMPLATE = "_template"
#: Where it lives in a source checkout, next to the package directory.
CHECKOUT_TEMPLATE = "cookiecutter-template"
#: The file the template's hook writes its rejection to, instead of stderr.
REPORT_ENV = "HFPATCH_SCAFFOLD_REPORT"


class ScaffoldError(HfPatchError):
    """``hfpatch new`` could not generate the project: a bad answer, an existing directory, ..."""


def template_path() -> Path:
    """The cookiecutter template directory: packaged with hfpatch-core, else the checkout's.

    Raises:
        ScaffoldError: neither exists (a broken installation).
    """
    package = Path(__file__).resolve().parent.parent  # hfpatch_core/, this module is in hfpatch_core/cli/
    candidates = (package / PACKAGED_TEMPLATE, package.parent / CHECKOUT_TEMPLATE)
    for candidate in candidates:
        if (candidate / "cookiecutter.json").is_file():
            return candidate
    raise ScaffoldError(
        f"the pack template is missing (looked for {candidates[0]} and {candidates[1]}); "
        "reinstall hfpatch-core with pip"
    )


def template_variables(template: Path | None = None) -> dict[str, Any]:
    """The template's questions and their (unrendered) defaults, in prompt order."""
    path = (template or template_path()) / "cookiecutter.json"
    variables: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return {name: value for name, value in variables.items() if not name.startswith("_")}


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def _quiet_hook_failures() -> Iterator[None]:
    """cookiecutter logs a traceback when a hook rejects the answers; the ScaffoldError says it all."""
    logger = logging.getLogger("cookiecutter.hooks")
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _create_directory(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents; return the ones created, deepest first."""
    missing: list[Path] = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScaffoldError(
            f"cannot create the output directory {path} ({exc.strerror or exc}); pass another one with -o DIR"
        ) from None
    return missing


def _context(
    template: Path,
    name: str | None,
    model_type: str | None,
    target: str | None,
    extra_context: Mapping[str, str] | None,
) -> dict[str, str]:
    variables = template_variables(template)
    context = dict(extra_context or {})
    unknown = sorted(set(context) - set(variables))
    if unknown:
        raise ScaffoldError(
            f"unknown template variable {', '.join(map(repr, unknown))}; "
            f"the pack template asks for {', '.join(variables)}"
        )
    for key, value in context.items():
        if not isinstance(value, str):
            raise ScaffoldError(f"template variable {key!r} must be a string, got {value!r}")
    if name is not None:
        context["pack_name"] = name
    if model_type is not None:
        context["model_type"] = model_type
    if target is not None:
        context["target_class"] = target
    return context


def _drop_bytecode(project: Path) -> None:
    """Remove what Python compiled inside the template: pip byte-compiles the installed template's
    valid Python files, and cookiecutter copies the ``__pycache__`` directories with the rest."""
    for cache in sorted(project.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache, ignore_errors=True)
    for compiled in project.rglob("*.py[co]"):
        compiled.unlink(missing_ok=True)


def new_pack(
    name: str | None = None,
    *,
    model_type: str | None = None,
    target: str | None = None,
    structural: bool = False,
    no_input: bool = False,
    output_dir: str | Path = ".",
    extra_context: Mapping[str, str] | None = None,
) -> Path:
    """Generate a pack project with cookiecutter and return its directory.

    Args:
        name: the pack's name (its entry point name, what ``HF_PATCH_PACKS`` selects);
            the project directory and distribution are ``hfpatch-pack-<name>``.
        model_type: the ``config.model_type`` the example patch applies to.
        target: the transformers class to replace (default: the model type's MLP class,
            ``LlamaMLP`` for ``llama``).
        structural: start from the structural example (``docs/examples/rms-norm``: the classes
            to replace found by what they compute, refused with a reason otherwise) instead of
            one class of one model type; the template variable ``variant``.
        no_input: use the given values and the template's defaults without prompting.
        output_dir: where to create the project directory.
        extra_context: more answers by template variable (``description``, ``author``,
            ``transformers_range``, ``project_slug``, ``module_name``, ...); ``name``,
            ``model_type`` and ``target`` take precedence.

    Raises:
        ScaffoldError: an answer was rejected, the project directory already exists, an
            unknown template variable was passed, or cookiecutter is missing.  Nothing is
            left behind.
    """
    try:
        from cookiecutter.exceptions import CookiecutterException, FailedHookException, OutputDirExistsException
        from cookiecutter.main import cookiecutter
    except ImportError:
        message = "hfpatch new needs cookiecutter, which is not installed: pip install cookiecutter"
        raise ScaffoldError(message) from None

    template = template_path()
    context = _context(template, name, model_type, target, extra_context)
    if structural:
        context["variant"] = "structural"
    root = Path(output_dir).expanduser().absolute()
    created = _create_directory(root)
    done = False
    try:
        try:
            staging = Path(tempfile.mkdtemp(prefix=".hfpatch-new-", dir=root))
        except OSError as exc:
            message = f"cannot write in {root} ({exc.strerror or exc}); pass another directory with -o DIR"
            raise ScaffoldError(message) from None
        try:
            report = staging / "hook-report"
            with _environment(REPORT_ENV, str(report)), _quiet_hook_failures():
                try:
                    generated = Path(
                        cookiecutter(
                            str(template), no_input=no_input, extra_context=context, output_dir=str(staging / "out")
                        )
                    )
                except FailedHookException as exc:
                    reason = report.read_text(encoding="utf-8").strip() if report.is_file() else ""
                    if reason:
                        raise ScaffoldError(f"the pack template rejected the answers: {reason}") from None
                    raise ScaffoldError(
                        f"the pack template's pre_gen_project hook failed ({exc}); its output above says why"
                    ) from None
                except OutputDirExistsException as exc:
                    raise ScaffoldError(f"{exc}; remove it or choose another pack name or output directory") from None
                except CookiecutterException as exc:
                    raise ScaffoldError(f"cookiecutter could not generate the project: {exc}") from None
            _drop_bytecode(generated)
            destination = root / generated.name
            if destination.exists() or destination.is_symlink():
                raise ScaffoldError(
                    f"{destination} already exists; remove it, choose another pack name, or pass another "
                    "output directory (-o DIR)"
                )
            try:
                generated.rename(destination)
            except OSError as exc:
                raise ScaffoldError(f"cannot create {destination} ({exc.strerror or exc})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        done = True
        return destination
    finally:
        if not done:
            for directory in created:
                with contextlib.suppress(OSError):
                    directory.rmdir()
