"""Real test distributions: a dist-info directory and a module on a temporary path."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from hfpatch_core.testing import install_pack


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """One pack distribution to write: entry point ``name`` -> module ``module``."""

    name: str
    source: str
    module: str = ""
    distribution: str = ""
    version: str = "1.0.0"
    summary: str = "A test pack"
    requires: tuple[str, ...] = ("transformers>=5.3,<6",)
    entry_value: str = ""

    @property
    def module_name(self) -> str:
        return self.module or "hfpatch_test_pack_" + self.name.replace("-", "_").replace(".", "_")

    @property
    def distribution_name(self) -> str:
        return self.distribution or f"hfpatch-pack-{self.name}"


def write_pack(site: Path, spec: PackSpec) -> Path:
    """Install ``spec`` into ``site`` as a distribution that importlib.metadata finds."""
    return install_pack(
        site,
        spec.name,
        spec.source,
        module=spec.module_name,
        entry_point=spec.entry_value or None,
        distribution=spec.distribution_name,
        version=spec.version,
        summary=spec.summary,
        requires=spec.requires,
    )


def install_packs(site: Path, specs: Iterable[PackSpec]) -> Path:
    for spec in specs:
        write_pack(site, spec)
    return site


MLP_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class PackMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        if context.model_type == "llama":
            return [Patch("LlamaMLP", PackMLP)]
        return []
"""

NORM_PATTERN_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class PackNorm(LlamaRMSNorm):
        pass

    @hookimpl
    def provide_patches(context):
        if context.model_type == "llama":
            return [Patch(".*RMSNorm$", PackNorm)]
        return []
"""


def mlp_pack(
    class_name: str = "PackMLP",
    *,
    target: str = "LlamaMLP",
    priority: int = 0,
    overwrite: bool = False,
    init_raises: bool = False,
) -> str:
    """Source of a pack replacing ``target`` with a LlamaMLP subclass called ``class_name``."""
    body = "raise RuntimeError('replacement init failed')" if init_raises else "super().__init__(*args, **kwargs)"
    return f"""
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class {class_name}(LlamaMLP):
    def __init__(self, *args, **kwargs):
        {body}

@hookimpl
def provide_patches(context):
    if context.model_type == "llama":
        return [Patch({target!r}, {class_name}, priority={priority}, overwrite={overwrite})]
    return []
"""


def _fused_qkv_classes(class_name: str) -> str:
    return f"""import torch
from torch import nn
from hfpatch_core import Converter, Patch, hookimpl
from hfpatch_core.authoring import SizedConcatenate
from transformers.core_model_loading import Concatenate, WeightConverter
from transformers.models.llama.modeling_llama import LlamaAttention


class _Slice(nn.Module):
    def __init__(self, owner, index):
        super().__init__()
        self.index = index
        object.__setattr__(self, "owner", owner)

    def forward(self, hidden_states):
        return self.owner._parts[self.index]


class {class_name}(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        q = config.num_attention_heads * self.head_dim
        kv = config.num_key_value_heads * self.head_dim
        self.sizes = (q, kv, kv)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(config.hidden_size, q + 2 * kv, bias=config.attention_bias)
        self.q_proj, self.k_proj, self.v_proj = (_Slice(self, i) for i in range(3))

    def forward(self, hidden_states, *args, **kwargs):
        self._parts = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            del self._parts
"""


def fused_qkv_pack(
    *, converter: str = "sized", priority: int = 0, class_name: str = "FusedQKVAttention", key: str = "llama"
) -> str:
    """A pack fusing LlamaAttention's q/k/v projections into one ``qkv_proj``.

    ``converter``: ``"sized"`` (exact), ``"chunk"`` (transformers' Concatenate, whose
    reverse splits equally: wrong for grouped-query attention) or ``"none"``.
    """
    return f"""
{_fused_qkv_classes(class_name)}

@hookimpl
def provide_patches(context):
    if context.model_type != "llama":
        return []
    return [Patch("LlamaAttention", {class_name}, priority={priority})]


@hookimpl
def provide_converters(context):
    if context.model_type != "llama" or {converter!r} == "none":
        return []
    config = context.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
             config.num_key_value_heads * head_dim)
    op = SizedConcatenate(dim=0, sizes=sizes) if {converter!r} == "sized" else Concatenate(dim=0)
    fuse = WeightConverter(
        source_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        target_patterns="self_attn.qkv_proj.weight",
        operations=[op],
    )
    return [Converter({key!r}, [fuse], priority={priority})]
"""


def fused_mlp_class(model_type: str = "llama", mlp: str = "LlamaMLP") -> str:
    """Source of ``FusedGateUpMLP``: ``mlp`` of ``model_type`` with gate/up fused into one ``gate_up_proj``."""
    return f"""
import torch
from torch import nn
from hfpatch_core import Converter, Patch, hookimpl
from hfpatch_core.authoring import SizedConcatenate
from transformers.core_model_loading import WeightConverter
from transformers.models.{model_type}.modeling_{model_type} import {mlp}


class FusedGateUpMLP({mlp}):
    def __init__(self, config):
        super().__init__(config)
        del self.gate_proj, self.up_proj
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)
"""


def fused_mlp_pack(model_type: str = "llama", mlp: str = "LlamaMLP") -> str:
    """A pack fusing ``mlp``'s gate/up for ``model_type``, with the converter its checkpoints need."""
    return f"""
{fused_mlp_class(model_type, mlp)}

@hookimpl
def provide_patches(context):
    return [Patch({mlp!r}, FusedGateUpMLP)] if context.model_type == {model_type!r} else []


@hookimpl
def provide_converters(context):
    if context.model_type != {model_type!r}:
        return []
    size = context.config.intermediate_size
    fuse = WeightConverter(
        source_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        target_patterns="mlp.gate_up_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(size, size))],
    )
    return [Converter({model_type!r}, [fuse])]
"""


_FUSED_MLP_CLASS = fused_mlp_class()
FUSED_MLP_PACK = fused_mlp_pack()


def fused_attention_and_mlp_pack(
    *, attention_targets: str = "('LlamaAttention',)", mlp_targets: str = "('LlamaMLP',)"
) -> str:
    """One pack fusing both q/k/v and gate/up, each converter naming the patch it serves.

    ``attention_targets`` / ``mlp_targets``: the ``patch_targets`` argument of each
    converter, as Python source.
    """
    return f"""
{_fused_qkv_classes("FusedQKVAttention")}
{_FUSED_MLP_CLASS}

@hookimpl
def provide_patches(context):
    if context.model_type != "llama":
        return []
    return [Patch("LlamaAttention", FusedQKVAttention), Patch("LlamaMLP", FusedGateUpMLP)]


@hookimpl
def provide_converters(context):
    if context.model_type != "llama" or context.config is None:
        return []
    config = context.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    qkv = WeightConverter(
        source_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        target_patterns="self_attn.qkv_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(q, kv, kv))],
    )
    size = config.intermediate_size
    gate_up = WeightConverter(
        source_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        target_patterns="mlp.gate_up_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(size, size))],
    )
    return [
        Converter("llama", [qkv], patch_targets={attention_targets}),
        Converter("llama", [gate_up], patch_targets={mlp_targets}),
    ]
"""


# A pack that changes the math on purpose: the MLP output is doubled.
# the forward is LlamaMLP's, but down_proj's weight is used detached: it never trains
DETACHED_PACK = """
import torch.nn.functional as F
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class DetachedMLP(LlamaMLP):
    def forward(self, x):
        hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return F.linear(hidden, self.down_proj.weight.detach())

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", DetachedMLP)] if context.model_type == "llama" else []
"""

DOUBLING_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class DoubledMLP(LlamaMLP):
    def forward(self, x):
        return 2 * super().forward(x)

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", DoubledMLP)] if context.model_type == "llama" else []
"""
