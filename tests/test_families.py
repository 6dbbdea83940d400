"""A quantized linear's tensor families through the sized operations, and a save that fails writing nothing.

The families are compressed-tensors' (llm-compressor's checkpoints): the real tool runs in
``interop/test_schemes.py`` (``make interop``); here the operations meet tensors of the
shapes and dtypes it writes, so that the rules hold on every release of the core suite.
"""

from __future__ import annotations

import copy as copy_module
import pickle
import re
from functools import partial

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core import WeightLayoutError
from hfpatch_core.authoring import (
    SizedConcatenate,
    describe_scheme,
    fused_linear_converters,
    fused_quantization_problem,
    fused_views_class,
)
from packs import PackSpec, fused_qkv_pack

SIZES = (32, 16, 16)
SOURCES, TARGET = ["q_proj.weight", "k_proj.weight", "v_proj.weight"], ["qkv_proj.weight"]
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 8}}},
}


def family(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """One part's W4A16 asymmetric family, group 8 over 16 inputs: the shapes compressed-tensors writes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "weight_packed": torch.randint(-(2**31), 2**31 - 1, (rows, 2), generator=generator, dtype=torch.int32),
        "weight_scale": torch.rand(rows, 2, generator=generator),
        "weight_zero_point": torch.randint(0, 2**31 - 1, (rows // 8, 2), generator=generator, dtype=torch.int32),
        "weight_shape": torch.tensor([rows, 16]),
        "weight_g_idx": torch.arange(16) // 8,
        "input_scale": torch.tensor([0.25]),
    }


def fuse(member: str, parts: list[torch.Tensor], **kwargs) -> torch.Tensor:
    full = f"model.layers.0.self_attn.qkv_proj.{member}"
    return SizedConcatenate(0, SIZES).convert(
        dict(zip(SOURCES, parts, strict=True)), SOURCES, TARGET, full_layer_name=full, **kwargs
    )[TARGET[0]]


def split(member: str, fused: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    full = f"model.layers.0.self_attn.q_proj.{member}"
    out = SizedConcatenate(0, SIZES).reverse_op.convert(
        {TARGET[0]: fused}, TARGET, SOURCES, full_layer_name=full, **kwargs
    )
    return [out[source] for source in SOURCES]


@pytest.mark.parametrize("member", ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape"])
def test_each_member_of_a_quantized_family_fuses_and_splits_back_exactly(member) -> None:
    parts = [family(rows, seed)[member] for seed, rows in enumerate(SIZES)]
    fused = fuse(member, parts)
    if member == "weight_shape":
        assert fused.tolist() == [64, 16] and fused.dtype == torch.int64
    else:
        assert fused.shape[0] == sum(part.shape[0] for part in parts)
    for back, part in zip(split(member, fused), parts, strict=True):
        assert back.dtype == part.dtype and torch.equal(back, part)


@pytest.mark.parametrize("member", ["weight_g_idx", "input_scale"])
def test_what_is_one_per_input_is_held_once_and_given_back_to_every_part(member) -> None:
    parts = [family(rows, 0)[member] for rows in SIZES]
    fused = fuse(member, parts)
    assert torch.equal(fused, parts[0])
    assert all(torch.equal(back, fused) for back in split(member, fused))


def test_per_tensor_scales_that_differ_are_refused_naming_tensors_and_scheme() -> None:
    fp8 = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            }
        },
    }
    config = type("Config", (), {"quantization_config": fp8})()
    same = [torch.tensor([0.5])] * 3
    assert torch.equal(fuse("weight_scale", same, config=config), same[0])  # one scale: held once
    with pytest.raises(WeightLayoutError) as raised:
        fuse("weight_scale", [torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([0.5])], config=config)
    message = str(raised.value)
    assert "model.layers.0.self_attn.k_proj.weight_scale" in message and "differs between the parts" in message
    assert "float-quantized: weights 8-bit float per tensor, activations 8-bit float per tensor (static)" in message


def test_rows_that_do_not_fit_the_sizes_and_unknown_members_are_refused() -> None:
    with pytest.raises(WeightLayoutError, match=r"weight_zero_point has 7 rows, which do not split into the parts"):
        split("weight_zero_point", torch.zeros(7, 2, dtype=torch.int32))
    with pytest.raises(WeightLayoutError, match=r"weight_scale has \[32, 16, 8\] rows"):
        fuse("weight_scale", [torch.ones(32, 1), torch.ones(16, 1), torch.ones(8, 1)])
    with pytest.raises(WeightLayoutError, match=r"does not know how to fuse the quantized tensor 'weight_mystery'"):
        fuse("weight_mystery", [torch.ones(rows, 1) for rows in SIZES])
    with pytest.raises(WeightLayoutError, match=r"records \[\[32, 16\], \[16, 8\], \[16, 16\]\]"):
        fuse("weight_shape", [torch.tensor([32, 16]), torch.tensor([16, 8]), torch.tensor([16, 16])])


def test_on_meta_tensors_the_members_keep_their_shapes() -> None:
    parts = [torch.empty(rows, 2, device="meta") for rows in SIZES]
    assert fuse("weight_scale", parts).shape == (64, 2)
    assert [tuple(part.shape) for part in split("weight_shape", torch.empty(2, device="meta"))] == [(2,)] * 3
    assert [tuple(part.shape) for part in split("input_scale", torch.empty(1, device="meta"))] == [(1,)] * 3


def test_the_scheme_reads_as_a_user_names_it() -> None:
    config = type("Config", (), {"quantization_config": W4A16})()
    assert describe_scheme(config=config) == (
        "compressed-tensors pack-quantized: weights 4-bit int per group of 8, activations unquantized"
    )


def test_fused_linear_converters_cover_weights_biases_and_activations() -> None:
    converters = fused_linear_converters("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj", SIZES, bias=True)
    assert [list(converter.source_patterns) for converter in converters] == [
        [f"self_attn.{part}.{suffix}" for part in ("q_proj", "k_proj", "v_proj")]
        for suffix in ("weight", "bias", "input_")
    ]
    assert [converter.target_patterns for converter in converters] == [
        ["self_attn.qkv_proj.weight"],
        ["self_attn.qkv_proj.bias"],
        ["self_attn.qkv_proj.input_"],
    ]


# --- which checkpoints load fused, and the module that holds them -------------------------------------

ATTENTION = "model.layers.0.self_attn"
PARTS = [f"{ATTENTION}.{part}" for part in ("q_proj", "k_proj", "v_proj")]


def quantized(**quantization) -> object:
    return type("Config", (), {"quantization_config": {**W4A16, **quantization}})()


def test_a_compressed_tensors_checkpoint_loads_fused_where_every_part_is_quantized_alike() -> None:
    problem = partial(fused_quantization_problem, fused=f"{ATTENTION}.qkv_proj", parts=PARTS)
    assert problem(type("Config", (), {})()) is None
    assert problem(quantized()) is None  # no targets: nothing quantized, alike
    assert problem(quantized(config_groups={"g": {"targets": ["Linear"]}}, ignore=["lm_head"])) is None
    assert problem(quantized(config_groups={"g": {"targets": ["re:.*self_attn.*"]}})) is None
    assert problem(quantized(config_groups={"g": {"targets": ["Linear"]}}, ignore=["re:.*layers.1.*"])) is None


@pytest.mark.parametrize(
    ("quantization", "reason"),
    [
        ({"config_groups": {"g": {"targets": ["Linear"]}}, "ignore": ["re:.*k_proj$"]}, r"k_proj: unquantized"),
        ({"config_groups": {"g": {"targets": ["re:.*q_proj$"]}}}, r"q_proj: \['g'\], k_proj: unquantized"),
        (
            {"config_groups": {"g": {"targets": [r"re:.*\.[qkv]_proj$"]}}},
            r"quantizes qkv_proj as unquantized, not as its parts \(\['g'\]\)",
        ),
        ({"config_groups": {"g": {"targets": ["Linear"]}}, "ignore": [f"{ATTENTION}.qkv_proj"]}, r"qkv_proj as unq"),
        ({"quant_method": "gptq"}, r"quantized by gptq.*compressed-tensors' tensor families only"),
        ({"transform_config": {"t": {}}}, r"with transforms"),
    ],
)
def test_a_checkpoint_the_fused_linear_cannot_hold_is_refused_with_the_reason(quantization, reason) -> None:
    problem = fused_quantization_problem(quantized(**quantization), f"{ATTENTION}.qkv_proj", PARTS)
    assert problem is not None and re.search(reason, problem), problem


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x)], dim=-1)


@pytest.mark.parametrize("quantizable", [False, True])
def test_the_quantizable_views_compute_the_parts_once_per_input(quantizable) -> None:
    """For a quantized checkpoint the fused projection is the ``nn.Linear`` a quantizer takes and the
    views are not; either way each view gives its part's output, from one call of the fused one."""

    torch.manual_seed(0)
    plain = Attention()
    fused_class = fused_views_class(
        Attention, {"qk_proj": ("q_proj", "k_proj")}, module=__name__, quantizable=quantizable
    )
    fused = fused_class()
    fused.qk_proj.load_state_dict(
        {
            "weight": torch.cat([plain.q_proj.weight, plain.k_proj.weight]),
            "bias": torch.cat([plain.q_proj.bias, plain.k_proj.bias]),
        }
    )
    linears = {name for name, module in fused.named_modules() if isinstance(module, torch.nn.Linear)}
    assert linears == ({"qk_proj"} if quantizable else {"q_proj", "k_proj"})
    assert [name for name, _ in fused.named_parameters()] == ["qk_proj.weight", "qk_proj.bias"]
    x = torch.randn(3, 8)
    for copy in (copy_module.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        torch.testing.assert_close(copy(x), plain(x), rtol=0, atol=1e-6)
    calls = []
    fused.qk_proj.register_forward_hook(lambda *_: calls.append(1))
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=1e-6)
    assert calls == [1] and fused.qk_proj._computed is None


# --- a save that fails writes nothing ----------------------------------------------------------------


@pytest.fixture
def patched(install, llama_checkpoint):
    install(PackSpec("qkv", fused_qkv_pack()))
    hfpatch_core.enable()
    yield AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.disable()


@pytest.fixture
def saves(tmp_path):
    """A directory of its own (the ``install`` fixture keeps its site in ``tmp_path``)."""
    (tmp_path / "saves").mkdir()
    return tmp_path / "saves"


def test_a_save_refused_on_the_meta_run_creates_no_directory(patched, saves) -> None:
    """A quantized tensor whose rows do not split into the parts is refused before any file."""
    attention = patched.model.layers[0].self_attn
    rows = attention.qkv_proj.weight.shape[0]
    attention.qkv_proj.register_buffer("weight_zero_point", torch.zeros(rows - 1, 1, dtype=torch.int8))
    with pytest.raises(WeightLayoutError, match="weight_zero_point has 63 rows"):
        patched.save_pretrained(saves / "out")
    assert list(saves.iterdir()) == []


def test_a_save_that_fails_half_way_leaves_the_directory_as_it_was(patched, saves) -> None:
    """A record that is wrong only in its values passes the meta run and fails while the weights are
    written, after transformers wrote the config: neither the new directory nor an earlier save's
    files are touched, and the model saves once the record is mended."""
    attention = patched.model.layers[0].self_attn
    rows, columns = attention.qkv_proj.weight.shape
    # a quantizer's tensors: a packed zero point (eight rows to one) and the record
    attention.qkv_proj.register_buffer("weight_zero_point", torch.zeros(rows // 8, 1, dtype=torch.int8))
    attention.qkv_proj.register_buffer("weight_shape", torch.tensor([rows + 1, columns]))
    with pytest.raises(WeightLayoutError, match=f"weight_shape records {rows + 1} rows, not {rows}"):
        patched.save_pretrained(saves / "new")
    assert list(saves.iterdir()) == []
    # nor the folders above it that the save would have created
    with pytest.raises(WeightLayoutError):
        patched.save_pretrained(saves / "runs" / "first" / "new")
    assert list(saves.iterdir()) == []

    earlier = saves / "earlier"
    earlier.mkdir()
    (earlier / "model-00001-of-00002.safetensors").write_bytes(b"an earlier save's shard")
    (earlier / "notes.txt").write_text("kept")
    with pytest.raises(WeightLayoutError):
        patched.save_pretrained(earlier)
    assert sorted(path.name for path in earlier.iterdir()) == ["model-00001-of-00002.safetensors", "notes.txt"]
    assert sorted(path.name for path in saves.iterdir()) == ["earlier"]

    attention.qkv_proj.weight_shape.copy_(torch.tensor([rows, columns]))
    patched.save_pretrained(earlier)
    names = sorted(path.name for path in earlier.iterdir())
    # transformers' own clean-up of an earlier save's shards, the rest of the directory kept
    assert "model-00001-of-00002.safetensors" not in names and "notes.txt" in names and "model.safetensors" in names
    with safe_open(str(earlier / "model.safetensors"), "pt") as saved:
        assert saved.get_tensor("model.layers.0.self_attn.k_proj.weight_shape").tolist() == [16, columns]


def test_a_save_off_the_main_process_removes_no_shard(patched, saves) -> None:
    """Only the main process cleans an earlier save's shards (as transformers does): another rank,
    whose staging holds nothing of them, must not remove the shards the main process just wrote."""
    shard = saves / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"the main process's shard")
    patched.save_pretrained(saves, is_main_process=False)
    assert shard.read_bytes() == b"the main process's shard"
