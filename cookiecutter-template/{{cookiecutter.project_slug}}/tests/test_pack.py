{% if cookiecutter.variant == "structural" -%}
"""The pack keeps the models whose norms it replaces correct.

``assert_pack_equivalent`` saves a tiny random checkpoint of each model type, loads it with
and without the pack in bfloat16, and checks that no weight is missing, that logits (within the
tolerance it calibrates in the same run, vanilla against itself) and greedy generation match,
and that ``save_pretrained`` writes the original checkpoint layout; with ``train_steps``, that 5
AdamW steps with and without the pack give the same losses, gradients and weights.  The pack
finds its classes by what they compute, so the tests name model types whose norms compute
different things, never the classes: what each replacement is called comes from the pack.
Run ``pytest`` once the pack is installed (``pip install -e ".[test]"``).

``test_pack_under_sharded_loads`` (``pytest -m distributed``, left out of a plain ``pytest``:
one torchrun of 2 ranks) proves the pack where transformers shards the model itself.

Every test here uses the ``hfpatch_isolation`` fixture of hfpatch-core's pytest plugin: it
starts with hfpatch disabled and ``HF_PATCH_PACKS`` / ``HF_PATCH_STRICT`` unset, and errors
if it leaves transformers' patch registry, conversion registry or output recorders changed.
"""

from pathlib import Path

import pytest
import torch
from hfpatch_core.testing import assert_pack_equivalent, tiny_checkpoint
from hfpatch_core.testing.distributed import verify_distributed

import {{ cookiecutter.module_name }} as pack

PACK = "{{ cookiecutter.pack_name }}"
#: Norms that compute rms_norm differently: Llama's (cast, then scale), Gemma2's (``1 + weight``),
#: Olmo2's (scale in float32, then cast), and Qwen3's q/k norms built inside its attention.
MODEL_TYPES = ("llama", "gemma2", "olmo2", "qwen3")
DISTRIBUTED = ("tp", "fsdp", "ep")

pytestmark = pytest.mark.usefixtures("hfpatch_isolation")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pack_keeps_the_model_equivalent(model_type: str) -> None:
    report = assert_pack_equivalent(PACK, model_type, dtype=torch.bfloat16, generate_tokens=5)
    assert report.replaced, f"{PACK} found no norm to replace in {model_type}"
    assert report.replaced == {target: pack.replacement_name(target) for target in report.replaced}


def test_pack_trains_like_the_original() -> None:
    report = assert_pack_equivalent(PACK, MODEL_TYPES[0], generate_tokens=0, train_steps=5)
    assert [training.gradient_checkpointing for training in report.training] == [False, True]


@pytest.mark.distributed
def test_pack_under_sharded_loads(tmp_path: Path) -> None:
    """Each of ``DISTRIBUTED`` on 2 ranks (torchrun, gloo, CPU), against one process."""
    checkpoint = tiny_checkpoint(MODEL_TYPES[0], tmp_path / MODEL_TYPES[0])
    reports = verify_distributed(PACK, checkpoint, DISTRIBUTED, model_type=MODEL_TYPES[0])
    assert [report.mode for report in reports] == list(DISTRIBUTED)
    failed = [f"{report.mode}: {report.detail}" for report in reports if not report.ok]
    assert not failed, "\n".join(failed)
{%- else -%}
"""The pack keeps models of its model type correct.

``assert_pack_equivalent`` saves a tiny random checkpoint of ``MODEL_TYPE``, loads it with
and without the pack, and checks that only ``TARGET`` was replaced, that no weight is
missing, that logits and greedy generation match, and that ``save_pretrained`` writes the
original checkpoint layout; with ``train_steps``, that 5 AdamW steps with and without the
pack give the same losses, gradients and weights, with gradient checkpointing off and on
(a replacement whose forward is right can still break the backward pass).  Run ``pytest``
once the pack is installed (``pip install -e ".[test]"``).

``test_pack_under_sharded_loads`` (``pytest -m distributed``, left out of a plain ``pytest``:
one torchrun of 2 ranks, about 20 s) proves the pack where transformers shards the model
itself, as ``hfpatch verify PACK --distributed tp,fsdp,ep`` does.

Every test here uses the ``hfpatch_isolation`` fixture of hfpatch-core's pytest plugin: it
starts with hfpatch disabled and ``HF_PATCH_PACKS`` / ``HF_PATCH_STRICT`` unset, and errors
if it leaves transformers' patch registry, conversion registry or output recorders changed
(a pack that leaks them changes every later load in the process).
"""

from pathlib import Path

import pytest
from hfpatch_core.testing import assert_pack_equivalent, tiny_checkpoint
from hfpatch_core.testing.distributed import verify_distributed

from {{ cookiecutter.module_name }} import REPLACEMENT

PACK = "{{ cookiecutter.pack_name }}"
MODEL_TYPE = "{{ cookiecutter.model_type }}"
TARGET = "{{ cookiecutter.target_class }}"
#: The sharded loads of ``test_pack_under_sharded_loads``: tensor parallel (``tp_plan="auto"``),
#: FSDP2 and expert parallel (``DistributedConfig(fsdp_size=2)`` / ``(ep_size=2)``).
DISTRIBUTED = ("tp", "fsdp", "ep")

pytestmark = pytest.mark.usefixtures("hfpatch_isolation")


def test_pack_keeps_the_model_equivalent() -> None:
    report = assert_pack_equivalent(PACK, MODEL_TYPE, expected_replacements=[TARGET])
    assert report.replaced == {TARGET: REPLACEMENT.__name__}


def test_pack_trains_like_the_original() -> None:
    report = assert_pack_equivalent(PACK, MODEL_TYPE, generate_tokens=0, train_steps=5)
    assert [training.gradient_checkpointing for training in report.training] == [False, True]


@pytest.mark.distributed
def test_pack_under_sharded_loads(tmp_path: Path) -> None:
    """Each of ``DISTRIBUTED`` on 2 ranks (torchrun, gloo, CPU), against one process.

    The pack passes a mode when it applies with the logits and greedy generation of a
    single-process vanilla load on every rank, when hfpatch refuses it cleanly (a
    replacement that changes the module's parameters without declaring how they shard
    loads vanilla: hfpatch-core's docs, "Scale"), or when the installed transformers has
    no such load of this model type (expert parallelism needs experts).
    """
    checkpoint = tiny_checkpoint(MODEL_TYPE, tmp_path / MODEL_TYPE)
    reports = verify_distributed(PACK, checkpoint, DISTRIBUTED, model_type=MODEL_TYPE)
    assert [report.mode for report in reports] == list(DISTRIBUTED)
    failed = [f"{report.mode}: {report.detail}" for report in reports if not report.ok]
    assert not failed, "\n".join(failed)
{%- endif %}
