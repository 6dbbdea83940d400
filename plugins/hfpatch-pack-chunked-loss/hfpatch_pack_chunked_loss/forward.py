"""The forward ``install`` puts on a model instance (``ChunkedForward``): a training step's loss in chunks of
tokens, read from the hidden states and the head where its rows live (``placement.at_step``); every other
call the model's own forward."""

from __future__ import annotations

import inspect
import logging
import operator
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfpatch_core import PackError, PackWarning
from hfpatch_core.settings import strict_for

from .budget import LOGIT_COPIES
from .found import Installed
from .loss import chunked_causal_lm_loss, logit_bytes_per_token
from .outputs import last_hidden
from .placement import at_step
from .rows import HeadRows, plain_linear

__all__ = ["FUSED_FLAG", "STATE", "ChunkedForward", "Watch", "active_head", "described", "installed_forward"]

# the model's attribute holding the installed forward (``installed``, ``uninstall``)
STATE = "_hfpatch_chunked_loss"

# the keyword TRL's ``add_fused_lm_head`` wrapper (every TRL 1.16 trainer's loss: SFT, GRPO, RLOO, DPO, KTO,
# AsyncGRPO) answers itself: with it set, the wrapper runs the decoder and its own tiled head and returns its
# own loss, so a pack installed over the wrapper passes such a call through untouched
FUSED_FLAG = "fused_lm_head"

logger = logging.getLogger("hfpatch")


class ChunkedForward:
    """The forward ``install`` puts on a model instance: a training step's loss in chunks, every other call
    the model's own forward.

    An object, not a closure: ``copy.deepcopy(model)`` copies it with the model (the copy computes with
    its own weights), ``pickle`` / ``torch.save(model)`` store it, and the model it refers to is freed
    with it (a cycle the garbage collector breaks).
    """

    def __init__(
        self,
        model: nn.Module,
        decoder: nn.Module,
        installed: Installed,
        original: Any,
        *,
        at_head: bool = False,
        linear_subclass: tuple[type, torch.dtype] | None = None,
    ) -> None:
        self.model = model
        self.decoder = decoder
        # the hidden states are the head's input (``probe.find``): read by a pre-hook on the head, which
        # hands the head the last position only (what logits_to_keep=1 gives elsewhere)
        self.at_head = at_head
        self.linear_subclass = linear_subclass
        self.active = False  # in a call of this forward (the decoder's hook then has nothing to say)
        self.watch: Watch | None = None
        self.handles: list[Any] = []  # the _Watch's hook on the decoder, removed by uninstall
        self.installed = installed
        # a forward set on the instance before the install (another wrapper): called as the original
        self.original = original
        self.disabled = False
        self.fell_back: set[str] = set()  # the kinds of vanilla fallback already warned about

    def read_hidden(self, head: nn.Module, call: Callable[[int], Any]) -> torch.Tensor | None:
        """The hidden states the chunked loss reads (every position) in ``call(logits_to_keep)``, a forward
        of the model that computes the last position's logits only; ``None`` when none were read.
        Called by ``token_log_probs``."""
        captured: list[torch.Tensor] = []
        handle = self._capture_hidden(head, captured, lambda: True)
        try:
            call(0 if self.at_head else 1)
        finally:
            handle.remove()
        return captured[0] if captured else None

    def _capture_hidden(self, head: nn.Module, captured: list[torch.Tensor], readable: Callable[[], bool]) -> Any:
        """A hook that appends the hidden states the loss reads to ``captured``, once, while ``readable()``:
        the decoder's output, or the head's input (then handed the last position only); its handle."""

        def after(module: nn.Module, args: Any, output: Any) -> None:
            hidden = last_hidden(output)
            if not captured and hidden is not None and readable():
                captured.append(hidden)

        def before(module: nn.Module, args: Any) -> Any:
            if captured or not readable():
                return None
            captured.append(args[0])
            return (args[0][..., -1:, :], *args[1:])

        return head.register_forward_pre_hook(before) if self.at_head else self.decoder.register_forward_hook(after)

    def _target(self) -> Callable[..., Any]:
        if self.original is not None:
            return self.original  # type: ignore[no-any-return,unused-ignore]
        return types.MethodType(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # Trainer reads the forward's signature (the dataset columns it keeps, loss kwargs), generate too
        return inspect.signature(self._target())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was, self.active = self.active, True
        try:
            return self._call(*args, **kwargs)
        finally:
            self.active = was

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        target = self._target()
        model, installed = self.model, self.installed
        if self.original is not None and kwargs.get(FUSED_FLAG) and not self.disabled:
            # the wrapper the install wrapped computes this call's loss itself (its labels are its own)
            if self.watch is not None and model.training and torch.is_grad_enabled():
                self.watch.bypassed(
                    f"{described(self.original)}, set on the model before chunked-loss's install, called with "
                    f"{FUSED_FLAG}=True"
                )
            return target(*args, **kwargs)
        arguments = dict(inspect.signature(target).bind(*args, **kwargs).arguments)
        labels = arguments.get("labels")
        extra = dict(arguments.pop("kwargs", {}) or {})
        get_head: Any = model.get_output_embeddings
        head = active_head(get_head(), self.linear_subclass)
        loss = installed.loss
        if (
            self.disabled
            or labels is None
            # loss arguments a forward that does not hand them to its loss ignores, or reads otherwise
            or (not (loss.loss_kwargs and loss.shift) and ("shift_labels" in extra or "ignore_index" in extra))
            or not model.training
            or not torch.is_grad_enabled()
            or head is None
            or arguments.get("logits_to_keep", 0) != 0
            or "adapter_names" in extra
        ):
            return target(*args, **kwargs)
        # where the head's rows live in this step (the model may have been sharded since the install); None: a
        # weight no reader reads (empty, not by ZeRO-3), vanilla's step
        rows = at_step(model, head)
        if rows is None:
            return target(*args, **kwargs)
        want_tuple = _wants_tuple(model, arguments, extra)
        arguments.update(labels=None, logits_to_keep=0 if self.at_head else 1)
        if "return_dict" in arguments:
            arguments["return_dict"] = True
        elif want_tuple:
            extra["return_dict"] = True
        captured: list[torch.Tensor] = []
        # the loss reads the head where its rows live when the decoder has returned (FSDP2 gathers it)
        handle = self._capture_hidden(head, captured, lambda: rows.readable(head))
        try:
            out = target(**arguments, **extra)
        finally:
            handle.remove()
        aux = getattr(out, "aux_loss", None)
        if not captured:
            # sharded otherwise since the install (a head made an FSDP2 unit of its own): vanilla's step
            self._fall_back(
                rows.unreadable("the LM head's weight is a DTensor")
                if not rows.readable(head)
                else "the step's forward never handed the head the decoder's hidden states"
            )
            return target(*args, **kwargs)
        if aux is not None and installed.aux_loss_coefficient is None:
            self._fall_back(
                "the forward returned an auxiliary loss (aux_loss) whose coefficient the install's probe did not "
                "find, so the chunked loss cannot add it as vanilla's does"
            )
            return target(*args, **kwargs)
        value = self._loss(rows, head, captured[0], labels, getattr(out, "logits", None), extra)
        if aux is not None:
            coefficient = operator.attrgetter(installed.aux_loss_coefficient)(model)  # type: ignore[arg-type]
            value = value + coefficient * aux.to(value.device)
        if self.watch is not None and model.__dict__.get("forward") is not self:
            self.watch.say(f"chunked-loss (called with labels by {described(model.__dict__.get('forward'))})")
        out.loss = value
        return out.to_tuple() if want_tuple else out

    def _loss(
        self, rows: HeadRows, head: nn.Linear, hidden: torch.Tensor, labels: Any, last: Any, extra: dict[str, Any]
    ) -> torch.Tensor:
        """The chunked loss of one step, over the head as its rows live (a ZeRO-3 head gathered once for it)."""
        installed, loss = self.installed, self.installed.loss
        with rows.reading(head) as (read, over):  # the head, or this rank's rows of it
            per_token = logit_bytes_per_token(hidden, read, installed.transform, LOGIT_COPIES)
            vocab = int(read.weight.shape[0])
            # the last position's logits the step returns, with what their graph saves, count as a chunk's tokens
            held = last.numel() // vocab * per_token if isinstance(last, torch.Tensor) else 0
            chunk = installed.chunk_of(vocab, held, per_token=per_token)
            if loss.loss_kwargs:
                loss_arguments = {
                    "num_items_in_batch": extra.get("num_items_in_batch"),
                    "ignore_index": extra.get("ignore_index", -100),
                    "shift_labels": extra.get("shift_labels") if loss.shift else labels,
                }
            else:
                # the mean over the counted tokens, as the forward's own CrossEntropyLoss computes it
                loss_arguments = {"shift_labels": None if loss.shift else labels}
            value: torch.Tensor = chunked_causal_lm_loss(
                hidden, read, labels, installed.transform, chunk=chunk, over=over, **loss_arguments
            )
        return value

    def _fall_back(self, reason: str) -> None:
        # the pack was installed, so its user expects the chunked step: a step that runs vanilla's instead
        # (its full logits, and this forward twice) is said once per model and reason
        if reason not in self.fell_back:
            self.fell_back.add(reason)
            logger.warning(
                "hfpatch: chunked-loss on %s: %s; this training step, and each like it, computes vanilla's full logits",
                type(self.model).__name__,
                reason,
            )


def described(function: Any) -> str:
    # functools.wraps gives a wrapper its wrapped function's name (TRL's fused head is named
    # LlamaForCausalLM.forward): the code object says where it was written
    function = getattr(function, "__func__", function)
    code, module = getattr(function, "__code__", None), getattr(function, "__globals__", {}).get("__name__")
    if code is None:
        return f"{type(function).__module__}.{type(function).__qualname__}"
    return f"{module}.{code.co_qualname}" if module else str(code.co_qualname)


class Watch:
    """A hook on the decoder: when ``model.forward`` was replaced after the install (TRL's
    ``add_fused_lm_head`` wraps it) and the wrapper runs the decoder itself in a training step, the
    wrapper computes that step's loss, not the pack (which computes it when the wrapper calls the
    forward it wrapped with labels).  The first step of each kind says which: the pack's at info level
    on the ``hfpatch`` logger, a wrapper's as a ``PackWarning`` (the selected pack computes nothing
    there: a user who selected it learns so without ``HF_PATCH_LOG``).
    """

    def __init__(self, forward: ChunkedForward) -> None:
        self.forward = forward
        self.said: set[str] = set()

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        forward = self.forward
        wrapper = forward.model.__dict__.get("forward")
        if forward.disabled or forward.active or wrapper is forward:
            return
        if forward.model.training and torch.is_grad_enabled():
            outer, caller = described(wrapper), _caller_of_the_decoder()
            # the forward set on the model may be a wrapper of the one that runs the decoder (accelerate's
            # autocast wrapper around TRL's fused head, under bf16): the one that runs it computes the loss
            inside = f"{caller}, inside " if caller is not None and caller != outer else ""
            self.bypassed(f"{inside}{outer}, which replaced the forward after chunked-loss's install")

    def say(self, who: str) -> None:
        """The pack computed a step's loss, called by ``who``: info, once per caller."""
        if who not in self.said:
            self.said.add(who)
            logger.info("hfpatch: %s: this training step's loss is computed by %s", self._name(), who)

    def bypassed(self, who: str) -> None:
        """``who``, not the pack, computed a training step's loss: a ``PackWarning``, once per model and ``who``."""
        if who in self.said:
            return
        self.said.add(who)
        message = (
            f"hfpatch: {self._name()}: this training step's loss is computed by {who}; chunked-loss computes none "
            "of the steps it answers (their loss, gradients and memory are the wrapper's own, as without the pack)"
        )
        if strict_for(self.forward.model):  # selected, and computing nothing: what strict mode refuses
            raise PackError("chunked-loss", message, stage="step")
        warnings.warn(message, PackWarning, stacklevel=2)

    def _name(self) -> str:
        return type(self.forward.model).__name__


def _caller_of_the_decoder() -> str | None:
    # called from a forward hook on the decoder: the first frame above it outside torch (the hook's caller,
    # nn.Module's call machinery) is the function that called the decoder, named where its code was written
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "torch":
        frame = frame.f_back
    if frame is None:
        return None
    module = frame.f_globals.get("__name__")
    return f"{module}.{frame.f_code.co_qualname}" if module else frame.f_code.co_qualname


def active_head(current: Any, linear_subclass: tuple[type, torch.dtype] | None = None) -> nn.Linear | None:
    """The plain ``nn.Linear`` a training step's head runs, or ``None`` (vanilla's step then runs).

    A head replaced since the install by another plain ``nn.Linear`` (``resize_token_embeddings``) is
    read as it is: the probe found what the forward does after the head, whichever head it is.  PEFT's
    ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) runs its active adapter's trained copy of
    the head, or the original one when adapters are disabled: that module is the head.  A subclass of
    ``nn.Linear`` the probe found computing nn.Linear's forward (``linear_subclass``: its class and the
    dtype it was probed in) is the head while its weight keeps that dtype.
    """
    if _linear(current, linear_subclass):
        return current
    original, copies = getattr(current, "original_module", None), getattr(current, "modules_to_save", None)
    if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
        return None
    active = list(getattr(current, "active_adapters", ()))
    if getattr(current, "disable_adapters", False) or not active or any(name not in copies for name in active):
        chosen = original
    else:
        chosen = copies[active[0]]
    return chosen if _linear(chosen, linear_subclass) else None  # type: ignore[return-value]


def _linear(module: Any, linear_subclass: tuple[type, torch.dtype] | None) -> bool:
    if plain_linear(module):
        return True
    return (
        linear_subclass is not None
        and type(module) is linear_subclass[0]
        and getattr(getattr(module, "weight", None), "dtype", None) == linear_subclass[1]
    )


def _wants_tuple(model: nn.Module, arguments: dict[str, Any], extra: dict[str, Any]) -> bool:
    asked = arguments.get("return_dict", extra.get("return_dict"))
    if asked is None:
        asked = getattr(getattr(model, "config", None), "return_dict", True)
    return not asked


def installed_forward(model: nn.Module) -> ChunkedForward | None:
    state = model.__dict__.get(STATE)
    return state if isinstance(state, ChunkedForward) and not state.disabled else None
