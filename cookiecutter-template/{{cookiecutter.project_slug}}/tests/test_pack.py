"""The pack keeps models of its model type correct.

``assert_pack_equivalent`` saves a tiny random checkpoint of ``MODEL_TYPE``, loads it with
and without the pack, and checks that only ``TARGET`` was replaced, that no weight is
missing, that logits and greedy generation match, and that ``save_pretrained`` writes the
original checkpoint layout; with ``train_steps``, that 5 AdamW steps with and without the
pack give the same losses, gradients and weights, with gradient checkpointing off and on
(a replacement whose forward is right can still break the backward pass).  Run ``pytest``
once the pack is installed (``pip install -e ".[test]"``).

Every test here uses the ``hfpatch_isolation`` fixture of hfpatch-core's pytest plugin: it
starts with hfpatch disabled and ``HF_PATCH_PACKS`` / ``HF_PATCH_STRICT`` unset, and errors
if it leaves transformers' patch registry, conversion registry or output recorders changed
(a pack that leaks them changes every later load in the process).
"""

import pytest
from hfpatch_core.testing import assert_pack_equivalent

PACK = "{{ cookiecutter.pack_name }}"
MODEL_TYPE = "{{ cookiecutter.model_type }}"
TARGET = "{{ cookiecutter.target_class }}"
REPLACEMENT = "{{ cookiecutter.__replacement_class }}"

pytestmark = pytest.mark.usefixtures("hfpatch_isolation")


def test_pack_keeps_the_model_equivalent() -> None:
    report = assert_pack_equivalent(PACK, MODEL_TYPE, expected_replacements=[TARGET])
    assert report.replaced == {TARGET: REPLACEMENT}


def test_pack_trains_like_the_original() -> None:
    report = assert_pack_equivalent(PACK, MODEL_TYPE, generate_tokens=0, train_steps=5)
    assert [training.gradient_checkpointing for training in report.training] == [False, True]
