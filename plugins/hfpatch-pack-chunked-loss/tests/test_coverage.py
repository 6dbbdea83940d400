"""Structures the probe reads generically (issue 45.6): hidden states read at the head's input, the
token-wise cross-entropies other than ForCausalLMLoss, a scale then a soft-cap, nn.Linear subclasses
that compute nn.Linear's forward; and the refusals that name what in the model prevents the rest."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from hfpatch_pack_chunked_loss import HeadTransform, LossKind
from transformers import AutoModelForCausalLM, BartConfig, BertConfig, LlamaForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from conftest import VOCAB, load, refused
from hfpatch_core.testing import tiny_checkpoint
from hfpatch_core.testing.zoo import verdict_of

# 2 x 24 tokens in chunks of 5, as test_exactness
BATCH, SEQUENCE, CHUNK = 2, 24, 5


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE), generator=generator)
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[1, -3:] = -100
    return input_ids, labels


def _step(model: Any, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), grads, out.logits.detach()


def _assert_vanilla(
    vanilla: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor],
    ours: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor],
) -> None:
    # fp32, the same per-token terms summed in another order (test_exactness's bounds and reasons)
    assert abs(float(ours[0] - vanilla[0])) <= 1e-6 * abs(float(vanilla[0]))
    assert ours[1].keys() == vanilla[1].keys()
    assert max(float((ours[1][n] - vanilla[1][n]).abs().max()) for n in vanilla[1]) <= 1e-5


_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "is_decoder": True,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
_BART = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}


@pytest.fixture(scope="module")
def more(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bert's MLM head (a transform between the encoder and the head) and bart's decoder-only head
    (an unshifted CrossEntropyLoss mean), saved by vanilla transformers."""
    root = tmp_path_factory.mktemp("coverage")
    return {
        "bert": tiny_checkpoint(BertConfig(**_BERT), root / "bert"),
        "bart": tiny_checkpoint(BartConfig(**_BART), root / "bart"),
    }


def _load(path: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.train()
    return model


def _known(*model_types: str) -> list[str]:
    # the model types of the installed transformers (minicpm3, muse_glimmer, ergo and dory are newer than
    # 5.3): the structures they stand for are also tested below on models built here
    return [model_type for model_type in model_types if model_type in CONFIG_MAPPING_NAMES]


# each was refused before: modernbert-decoder's and minicpm3's head input is no sub-module's last hidden
# state (a prediction head's bare tensor, a division), bart's and xlnet's losses are unshifted means,
# muse_glimmer scales then soft-caps, ergo's head is an nn.Linear subclass.  (bert's MLM transform is
# tested on a checkpoint of its own below: transformers 5.3 does not save bert's LayerNorm as it reads it,
# so the zoo has no checkpoint of it there.)
@pytest.mark.parametrize(
    "model_type", _known("modernbert-decoder", "minicpm3", "bart", "xlnet", "muse_glimmer", "ergo")
)
def test_exact_in_the_zoo(model_type: str, tmp_path: Path) -> None:
    row = verdict_of("chunked-loss", model_type, tmp_path, generate_tokens=0)
    assert row.verdict == "exact", row.detail
    assert row.detail == f"model step {chunked.TARGET} [chunked-loss]"
    assert row.report.step_loss_diff is not None


@pytest.mark.parametrize("model_type", ["modernbert-decoder", "bart"])
def test_exact_in_the_zoo_in_bfloat16(model_type: str, tmp_path: Path) -> None:
    row = verdict_of("chunked-loss", model_type, tmp_path, generate_tokens=0, dtype=torch.bfloat16)
    assert row.verdict == "exact", row.detail


def test_an_mlm_head_transform_is_read_at_the_head(more: dict[str, Path]) -> None:
    input_ids, labels = _batch()
    vanilla = _step(_load(more["bert"]), input_ids=input_ids, labels=labels)
    model = _load(more["bert"])
    found = chunked.install(model, chunk=CHUNK)
    assert found.loss == LossKind(shift=True, loss_kwargs=True)
    ours = _step(model, input_ids=input_ids, labels=labels)
    _assert_vanilla(vanilla, ours)
    # the transform ran on every token, the head on the last position only (as logits_to_keep=1)
    assert ours[2].shape == (BATCH, 1, VOCAB)
    # a one-row matmul sums in another order than the 48-row one: a float32 ulp at logits below one
    assert torch.allclose(ours[2], vanilla[2][:, -1:], rtol=0, atol=1e-6)
    assert "cls.predictions.transform.dense.weight" in ours[1]


def test_a_pre_hook_on_the_head_is_read_with_it(checkpoints: dict[str, Path]) -> None:
    """What runs between the decoder and the head (here a user's pre-hook) is vanilla's, read at the head."""
    input_ids, labels = _batch()
    reference = load(checkpoints["llama"])
    reference.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    vanilla = _step(reference, input_ids=input_ids, labels=labels)
    model = load(checkpoints["llama"])
    model.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    chunked.install(model, chunk=CHUNK)
    _assert_vanilla(vanilla, _step(model, input_ids=input_ids, labels=labels))


@pytest.mark.parametrize("num_items", [None, 17])
def test_an_unshifted_mean_is_vanilla_whatever_num_items_in_batch(more: dict[str, Path], num_items: int | None) -> None:
    """bart's CrossEntropyLoss compares the logits at t with the label at t and ignores
    num_items_in_batch (Trainer passes it): the chunked loss does the same."""
    input_ids, labels = _batch(1)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    vanilla = _step(_load(more["bart"]), input_ids=input_ids, labels=labels, **extra)
    model = _load(more["bart"])
    assert chunked.install(model, chunk=CHUNK).loss == LossKind(shift=False, loss_kwargs=False)
    ours = _step(model, input_ids=input_ids, labels=labels, **extra)
    _assert_vanilla(vanilla, ours)
    assert ours[2].shape == (BATCH, 1, VOCAB)


def test_loss_arguments_a_forward_does_not_read_leave_the_step_vanillas(more: dict[str, Path]) -> None:
    # bart's forward hands shift_labels to its decoder, not to its loss: what vanilla does with it is
    # vanilla's business, so the step is vanilla's (the whole logits)
    input_ids, labels = _batch(2)
    vanilla = _step(_load(more["bart"]), input_ids=input_ids, labels=labels, shift_labels=labels)
    model = _load(more["bart"])
    chunked.install(model, chunk=CHUNK)
    ours = _step(model, input_ids=input_ids, labels=labels, shift_labels=labels)
    assert torch.equal(ours[0], vanilla[0])
    assert ours[2].shape == (BATCH, SEQUENCE, VOCAB)


def _an_ulp_under_autograd(module: Any, args: Any, output: Any) -> Any:
    # doge's forward takes another kernel under autograd: its hidden states round otherwise by an ulp
    if torch.is_grad_enabled():
        output.last_hidden_state = torch.nextafter(output.last_hidden_state, torch.tensor(float("inf")))
    return output


def test_hidden_states_that_round_otherwise_under_autograd_are_the_same_hidden_states(
    checkpoints: dict[str, Path],
) -> None:
    """The probe's call without labels runs under no_grad, its call with labels under autograd: the
    check that labels do not change the hidden states (florence2's decoder inputs) allows rounding."""
    input_ids, labels = _batch()
    reference = load(checkpoints["llama"])
    reference.model.register_forward_hook(_an_ulp_under_autograd)
    vanilla = _step(reference, input_ids=input_ids, labels=labels)
    model = load(checkpoints["llama"])
    model.model.register_forward_hook(_an_ulp_under_autograd)
    chunked.install(model, chunk=CHUNK)
    _assert_vanilla(vanilla, _step(model, input_ids=input_ids, labels=labels))


def test_a_scale_then_a_soft_cap(checkpoints: dict[str, Path]) -> None:
    class _Prescaled(LlamaForCausalLM):
        """muse_glimmer's order: logits * 0.7, then a soft-cap of 3 (neither alone fits)."""

        def forward(  # type: ignore[override]
            self, input_ids: Any = None, labels: Any = None, logits_to_keep: int = 0, **kwargs: Any
        ) -> Any:
            out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = torch.tanh(out.logits * 0.7 / 3.0) * 3.0
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, self.config.vocab_size, **kwargs)
            return out

    input_ids, labels = _batch()
    vanilla = _step(_Prescaled.from_pretrained(checkpoints["llama"]).train(), input_ids=input_ids, labels=labels)
    model = _Prescaled.from_pretrained(checkpoints["llama"]).train()
    transform = chunked.install(model, chunk=CHUNK).transform
    assert transform == HeadTransform(softcap=3.0, prescale=float(torch.tensor(0.7, dtype=torch.float32)))
    _assert_vanilla(vanilla, _step(model, input_ids=input_ids, labels=labels))
    # the other order, with the same numbers, misses vanilla's logits
    probe = torch.linspace(-20, 20, 101)
    assert not torch.allclose(HeadTransform(scale=0.7, softcap=3.0)(probe), transform(probe), atol=1e-3)


class _ScaledHead(torch.nn.Linear):
    """An nn.Linear subclass with a parameter of its own (dory's learned per-token scale)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__(head.in_features, head.out_features, bias=False)
        self.weight = head.weight
        self.logit_scale = torch.nn.Parameter(torch.ones(head.out_features))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) * self.logit_scale


class _UpcastHead(torch.nn.Linear):
    """ergo's head: the linear computed in float32, which in float32 is nn.Linear's."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight.float())


class _OtherHead(torch.nn.Linear):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight).clamp(-0.01, 0.01)


def _with_head(model: Any, kind: type) -> Any:
    head = kind(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    return model


def test_an_nn_linear_subclass_computing_nn_linears_forward(checkpoints: dict[str, Path]) -> None:
    input_ids, labels = _batch()
    vanilla = _step(_with_head(load(checkpoints["llama"]), _UpcastHead), input_ids=input_ids, labels=labels)
    model = _with_head(load(checkpoints["llama"]), _UpcastHead)
    chunked.install(model, chunk=CHUNK)
    ours = _step(model, input_ids=input_ids, labels=labels)
    _assert_vanilla(vanilla, ours)
    assert ours[2].shape == (BATCH, 1, VOCAB)
    # in bfloat16 it computes in float32 what nn.Linear computes in bfloat16: a step there is vanilla's
    model.to(torch.bfloat16)
    assert _step(model, input_ids=input_ids, labels=labels)[2].shape == (BATCH, SEQUENCE, VOCAB)


def test_an_nn_linear_subclass_that_computes_otherwise_is_refused(checkpoints: dict[str, Path]) -> None:
    reason = refused(_with_head(load(checkpoints["llama"]), _OtherHead))
    assert reason.startswith("the LM head is a _OtherHead, an nn.Linear subclass whose forward does not compute")
    model = load(checkpoints["llama"])
    model.lm_head = _ScaledHead(model.lm_head)
    assert refused(model) == (
        "the LM head is a _ScaledHead, an nn.Linear with parameters of its own (logit_scale) that its forward "
        "applies to the logits: the chunked loss computes a plain linear head"
    )


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        (model_type, reason)
        for model_type, reason in (
            # a learned per-token scale of the logits, a parameter
            ("dory", "the LM head is a DoryLMHead, an nn.Linear with parameters of its own (logit_scale)"),
            # block-sparse attention falls back to full attention on short inputs, by swapping its modules
            ("big_bird", "the model's forward replaced its own modules on the probe's 4 tokens"),
            # an encoder-decoder whose decoder inputs are the shifted labels
            ("florence2", "the forward computes other hidden states with labels ((1, 4, "),
        )
        if model_type in CONFIG_MAPPING_NAMES
    ],
)
def test_refused_for_what_is_in_the_model(model_type: str, reason: str, tmp_path: Path) -> None:
    row = verdict_of("chunked-loss", model_type, tmp_path, generate_tokens=0)
    assert row.verdict == "refused", row.detail
    assert row.detail.startswith(f"{chunked.TARGET}: {reason}"), row.detail


def test_a_model_read_at_its_head_copies_pickles_and_is_freed(more: dict[str, Path]) -> None:
    input_ids, labels = _batch()
    model = _load(more["bert"])
    chunked.install(model, chunk=CHUNK)
    loss = _step(model, input_ids=input_ids, labels=labels)[0]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.cls.predictions.transform.dense.weight.mul_(2)
    changed = _load(more["bert"])
    with torch.no_grad():
        changed.cls.predictions.transform.dense.weight.mul_(2)
    # the copy computes with its own transform (read at its own head)
    _assert_vanilla(_step(changed, input_ids=input_ids, labels=labels), _step(twin, input_ids=input_ids, labels=labels))
    assert torch.equal(_step(model, input_ids=input_ids, labels=labels)[0], loss)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert chunked.installed(restored) is not None
    assert torch.equal(_step(restored, input_ids=input_ids, labels=labels)[0], loss)
    assert pickle.loads(pickle.dumps(chunked.installed(model))) == chunked.installed(model)
    ref = weakref.ref(model)
    del model, twin, restored
    gc.collect()
    assert ref() is None


def test_token_log_probs_read_at_the_head(more: dict[str, Path]) -> None:
    """GRPO's and DPO's per-token log-probabilities read the hidden states where the step does."""
    input_ids, _ = _batch(3)
    weights = torch.linspace(-1.0, 1.0, SEQUENCE - 1).expand(BATCH, -1)
    vanilla = _load(more["bert"])
    logits = vanilla(input_ids=input_ids).logits[:, :-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    (expected * weights).sum().backward()
    model = _load(more["bert"])
    chunked.install(model, chunk=CHUNK)
    values = chunked.token_log_probs(model, input_ids, temperature=0.7)
    (values * weights).sum().backward()
    # fp32: the same per-token operations (test_logprobs's bound)
    torch.testing.assert_close(values, expected.detach(), rtol=0, atol=1e-5)
    theirs = {name: p.grad for name, p in vanilla.named_parameters() if p.grad is not None}
    ours = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys()
    assert max(float((ours[name] - theirs[name]).abs().max()) for name in theirs) <= 1e-5
