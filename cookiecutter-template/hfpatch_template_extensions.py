"""Jinja filters of the pack template, loaded through ``_extensions`` in cookiecutter.json.

cookiecutter puts the template directory on ``sys.path`` while it renders, so this module
is importable then; its name is specific to keep clear of other templates' extensions.
"""

import re

from cookiecutter.utils import simple_filter


@simple_filter
def mlp_class(model_type):
    """The conventional MLP class name of a model type: ``qwen2`` -> ``Qwen2MLP``.

    Derived from the model type's config class name (``Qwen2Config``), without importing
    the modeling module; it is only the suggested answer, which the pre_gen_project hook
    checks against the modeling module.
    """
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        CONFIG_MAPPING_NAMES = {}
    config = CONFIG_MAPPING_NAMES.get(str(model_type), "")
    if config.endswith("Config") and config != "Config":
        return config[: -len("Config")] + "MLP"
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_]", str(model_type))) + "MLP"


@simple_filter
def drift_record(pack_name, model_type, target_class, variant="class"):
    """The pack's drift record (what ``hfpatch check --record`` writes) on the transformers
    installed where the project is generated: the signatures of ``target_class``.

    Empty (no release recorded: ``hfpatch check`` says so, and does not fail) without
    hfpatch-core there, and for the structural variant: what a structural pack replaces is
    known only by asking it about every model type (``hfpatch check --record``, about a
    minute), which generating the project does not do.
    """
    import json

    empty = json.dumps({"format": 1, "pack": pack_name, "releases": {}}, indent=2) + "\n"
    if variant == "structural":
        return empty
    try:
        import transformers

        from hfpatch_core._pipeline.probing import targets_of
        from hfpatch_core.authoring.drift import DriftRecord
    except ImportError:
        return empty
    targets = targets_of(str(model_type), [str(target_class)])
    return DriftRecord(str(pack_name), {}).with_release(transformers.__version__, targets).dumps()
