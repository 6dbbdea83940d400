"""Check the answers before cookiecutter writes the pack project.

A bad answer is reported on stderr (or, under ``hfpatch new``, in the file named by
``HFPATCH_SCAFFOLD_REPORT``) and the hook exits with status 1; cookiecutter then removes
the project directory it created.  Every problem is reported at once.
"""

import difflib
import keyword
import os
import re
import sys

ANSWERS = {
    "pack_name": {{ cookiecutter.pack_name | tojson }},
    "project_slug": {{ cookiecutter.project_slug | tojson }},
    "module_name": {{ cookiecutter.module_name | tojson }},
    "model_type": {{ cookiecutter.model_type | tojson }},
    "target_class": {{ cookiecutter.target_class | tojson }},
    "transformers_range": {{ cookiecutter.transformers_range | tojson }},
}
# target_class's default, derived from model_type: a wrong model type makes it wrong too,
# and saying so would be a second report of the same mistake.
DEFAULT_TARGET = {{ cookiecutter.model_type | mlp_class | tojson }}

REPORT_ENV = "HFPATCH_SCAFFOLD_REPORT"

# Entry point names hfpatch accepts (HF_PATCH_PACKS items), kept to lowercase so that the
# distribution name hfpatch-pack-<name> is already normalised.
PACK_NAME = re.compile(r"[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?")
# PEP 508 distribution names.
DISTRIBUTION_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
# Words with a meaning of their own in HF_PATCH_PACKS.
RESERVED_PACK_NAMES = ("all", "none")


def did_you_mean(word, choices):
    """'; did you mean 'a', 'b' or 'c'?' for the close matches of ``word`` (empty when there is none)."""
    matches = [repr(match) for match in difflib.get_close_matches(str(word), list(choices), n=3, cutoff=0.6)]
    if not matches:
        return ""
    listed = matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"
    return f"; did you mean {listed}?"


def fixed_pack_name(name):
    fixed = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")
    return fixed or "my-pack"


def check_names(answers):
    problems = []
    pack, slug, module = answers["pack_name"], answers["project_slug"], answers["module_name"]
    pack_ok = isinstance(pack, str) and PACK_NAME.fullmatch(pack) is not None and pack not in RESERVED_PACK_NAMES
    if not pack_ok:
        if pack in RESERVED_PACK_NAMES:
            problems.append(
                f"pack_name {pack!r} is reserved: HF_PATCH_PACKS uses 'all' and 'none' as keywords; choose another name."
            )
        else:
            problems.append(
                f"pack_name {pack!r} is not a valid pack name: use lowercase letters, digits, '-', '.' and '_', "
                f"starting and ending with a letter or digit (e.g. {fixed_pack_name(str(pack))!r})."
            )
    # A slug or module name derived from a bad pack name is bad for the same reason: say it once.
    derived_slug = f"hfpatch-pack-{pack}"
    derived_module = "hfpatch_pack_" + str(pack).lower().replace("-", "_").replace(".", "_")
    if (pack_ok or slug != derived_slug) and DISTRIBUTION_NAME.fullmatch(slug) is None:
        problems.append(
            f"project_slug {slug!r} is not a valid directory and distribution name: use letters, digits, "
            "'-', '.' and '_', starting and ending with a letter or digit (e.g. 'hfpatch-pack-my-pack')."
        )
    if pack_ok or module != derived_module:
        if not module.isidentifier() or keyword.iskeyword(module):
            problems.append(
                f"module_name {module!r} is not a valid Python identifier: use letters, digits and '_', "
                "not starting with a digit (e.g. 'hfpatch_pack_my_pack')."
            )
        elif module in sys.stdlib_module_names or module in ("hfpatch_core", "transformers", "torch", "tests"):
            problems.append(f"module_name {module!r} would shadow an existing module; choose another name.")
    return problems


def check_range(answers):
    value = answers["transformers_range"]
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:  # checked again by pip when the pack is installed
        return [], None
    try:
        specifier = SpecifierSet(value)
    except InvalidSpecifier:
        return [
            f"transformers_range {value!r} is not a version specifier: write it like '>=5.3,<6' "
            "(comparison operators and versions, separated by commas)."
        ], None
    return [], specifier


def check_model(answers, specifier):
    """Problems with model_type / target_class, and warnings (found only with transformers installed).

    An unknown model_type does not hide a wrong target_class: the target is checked against
    the closest model type, so that both are reported at once.
    """
    model_type, target = answers["model_type"], answers["target_class"]
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return [], ["transformers is not installed here, so model_type and target_class were not checked."]
    version = transformers.__version__
    warnings = []
    if specifier is not None and not specifier.contains(version, prereleases=True):
        warnings.append(
            f"the installed transformers {version} is outside transformers_range {str(specifier)!r}: "
            "hfpatch will skip the pack here and its tests will fail."
        )
    if model_type not in CONFIG_MAPPING_NAMES:
        hint = did_you_mean(model_type, CONFIG_MAPPING_NAMES) or "; use the model_type of a checkpoint's config.json."
        problems = [f"model_type {model_type!r} is not a model type transformers {version} knows{hint}"]
        closest = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=1, cutoff=0.6)
        if closest and target != DEFAULT_TARGET:
            problem, _ = check_target(closest[0], target)
            if problem:
                problems.append(f"for the closest model type, {closest[0]!r}: {problem}")
        return problems, warnings
    problem, module = check_target(model_type, target)
    if module is not None:
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                warnings.append(
                    f"{model_type!r} has no causal LM class: tests/test_pack.py loads a tiny checkpoint with "
                    "AutoModelForCausalLM, so pass it a checkpoint directory your model class loads instead."
                )
        except ImportError:
            pass
    return ([problem] if problem else []), warnings


def check_target(model_type, target):
    """Why ``target`` is not a module class of ``model_type``'s modeling module (``None`` when it is
    one), and that module (``None`` when it cannot be imported)."""
    import importlib

    module_name = model_type.replace("-", "_")
    modeling = f"transformers.models.{module_name}.modeling_{module_name}"
    try:
        module = importlib.import_module(modeling)
        import torch.nn as nn
        from transformers import PreTrainedModel
    except ImportError as exc:
        return (
            f"model_type {model_type!r} has no importable modeling module {modeling} ({exc}); "
            "choose the model type whose modeling module defines the class to replace."
        ), None
    defined = sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, nn.Module)
        and value.__module__ == module.__name__
        and not issubclass(value, PreTrainedModel)
    )
    if target in defined:
        return None, module
    value = getattr(module, target, None)
    if isinstance(value, type) and issubclass(value, PreTrainedModel):
        problem = f"target_class {target!r} is a whole model class of {modeling}; a pack replaces its building blocks"
    elif isinstance(value, type) and issubclass(value, nn.Module):
        problem = f"target_class {target!r} is not defined in {modeling} (it is imported from {value.__module__})"
    elif value is not None:
        problem = f"target_class {target!r} of {modeling} is not an nn.Module class"
    else:
        problem = f"target_class {target!r} is not defined in {modeling}"
    hint = did_you_mean(target, defined)
    if not hint:
        listed = ", ".join(defined[:15]) + (", ..." if len(defined) > 15 else "")
        hint = f"; its module classes are {listed}." if defined else "; it defines no module class to replace."
    return problem + hint, module


def remove_rendered_copy():
    """cookiecutter runs a rendered copy of this hook from a temporary file and leaves it there."""
    here = os.path.abspath(__file__)
    if os.path.basename(os.path.dirname(here)) != "hooks":
        try:
            os.remove(here)
        except OSError:
            pass


def main():
    remove_rendered_copy()
    problems = check_names(ANSWERS)
    range_problems, specifier = check_range(ANSWERS)
    problems += range_problems
    model_problems, warnings = check_model(ANSWERS, specifier)
    problems += model_problems
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not problems:
        return 0
    message = " ".join(problems)
    report = os.environ.get(REPORT_ENV)
    if report:
        with open(report, "w", encoding="utf-8") as handle:
            handle.write(message)
    else:
        print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
