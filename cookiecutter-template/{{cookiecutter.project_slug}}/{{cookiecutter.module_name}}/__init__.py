{%- set target = cookiecutter.target_class -%}
{%- set replacement = cookiecutter.__replacement_class -%}
{%- set import_line = "from " ~ cookiecutter.__modeling_module ~ " import " ~ target -%}
"""{{ cookiecutter.description.rstrip('.') | replace('\\', '\\\\') | replace('"', '\\"') | wordwrap(96, break_long_words=False) }}.

An hfpatch patch pack: while hfpatch is enabled, models of type ``MODEL_TYPE`` load with
the class ``TARGET`` replaced by the subclass below, for that load only.  The entry point
(group ``hfpatch.packs``, see pyproject.toml) names this module, and hfpatch calls the
functions marked with ``@hookimpl``.
"""

from __future__ import annotations

from typing import Any

from hfpatch_core import LoadContext, Patch, hookimpl
{% if import_line | length <= 120 -%}
{{ import_line }}
{%- else -%}
from {{ cookiecutter.__modeling_module }} import (
    {{ target }},
)
{%- endif %}

__all__ = ["MODEL_TYPE", "TARGET", "{{ replacement }}", "provide_patches"]

#: The ``config.model_type`` this pack patches.
MODEL_TYPE = "{{ cookiecutter.model_type }}"
#: The transformers class it replaces.
TARGET = "{{ target }}"


class {{ replacement }}({{ target }}):
    """A drop-in replacement for ``{{ target }}``.

    transformers builds it with the same ``__init__`` arguments as the original class,
    and it must load the same checkpoint weights (or declare a converter: see
    ``provide_converters`` below).  Make ``forward`` faster and keep what it returns:
    ``tests/test_pack.py`` checks that the patched model's outputs do not change.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


@hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    """Replace ``TARGET`` in ``MODEL_TYPE`` models; leave every other model alone."""
    if context.model_type == MODEL_TYPE:
        return [Patch(TARGET, {{ replacement }})]
    return []


# A replacement that stores its weights differently from the original (below: an MLP
# whose gate_proj and up_proj are fused into one gate_up_proj) declares how checkpoint
# tensors map onto its layout.  SizedConcatenate knows the size of each part, so
# save_pretrained splits the fused tensor back into the original checkpoint layout.
# Uncomment, adapt the patterns to the weights your class changes, and keep the tests
# passing.  context.config is None when `hfpatch check` asks without a config.
#
# from hfpatch_core import Converter, SizedConcatenate
# from transformers.core_model_loading import WeightConverter
#
#
# @hookimpl
# def provide_converters(context: LoadContext) -> list[Converter]:
#     if context.model_type != MODEL_TYPE or context.config is None:
#         return []
#     size = context.config.intermediate_size
#     fuse = WeightConverter(
#         source_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
#         target_patterns="mlp.gate_up_proj.weight",
#         operations=[SizedConcatenate(dim=0, sizes=(size, size))],
#     )
#     return [Converter(MODEL_TYPE, [fuse])]
