"""BitSparse for Hugging Face's ``Trainer``: one line to compress what training forwards save.

    from bitsparse.integrations.transformers import BitSparseTrainer

    trainer = BitSparseTrainer(model=model, args=args, train_dataset=data)   # instead of Trainer
    trainer.train()    # ReLU-family activations saved for backward are stored compressed

``BitSparseTrainerMixin`` does the same for a Trainer subclass of your own
(``class MyTrainer(BitSparseTrainerMixin, MyBaseTrainer)``), and ``BitSparseCallback`` adds the
statistics to the logs of a plain ``Trainer`` that compresses some other way (``bitsparse.enable()``).
Needs ``transformers`` and ``accelerate`` (``pip install -e ".[transformers]"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import bitsparse
from bitsparse.integrations.common import PREFIX, StepReporter, checked_options

__all__ = ["BitSparseCallback", "BitSparseTrainer", "BitSparseTrainerMixin"]


class BitSparseTrainerMixin:
    """Runs a ``Trainer``'s training forward passes under ``bitsparse.compressing(**options)``.

    Put it before the Trainer class: ``class MyTrainer(BitSparseTrainerMixin, Trainer)``. It
    overrides ``compute_loss_context_manager()``, inside which ``Trainer.training_step`` runs
    the forward pass (``compute_loss``), and enters ``compressing()`` there when gradients are
    enabled. Backward runs after that block and restores the stored tensors bit for bit, so
    losses, gradients and weights are identical to the plain Trainer's.

    - Gradient accumulation: each micro-batch's forward is its own ``compressing()`` block,
      followed by its backward (one BitSparse step per micro-batch).
    - Evaluation and prediction: ``prediction_step`` enters the same context manager under
      ``torch.no_grad()``, where nothing is saved for backward; BitSparse is not entered there,
      so evaluation neither stores anything nor starts a BitSparse step.
    - Gradient checkpointing (``gradient_checkpointing=True``, non-reentrant by default):
      saved-tensor hooks are thread-local and the innermost pair wins, so inside each
      checkpointed layer checkpointing's own hooks apply and only the region's inputs (and
      whatever is saved outside the checkpointed layers) reach BitSparse. Results are still
      identical; what BitSparse saves shrinks to what checkpointing keeps.
    - Logging: every log made after new training steps gets ``bitsparse/...`` fields
      (``bitsparse.integrations.common.log_fields``: compression ratio, dense and stored
      MiB, tensors compressed, fallbacks, zero fraction) describing the last micro-batch. They
      are added in ``log()``, before the Trainer records them, so they reach
      ``state.log_history`` and every callback (TensorBoard, W&B, the console). Reading them
      synchronizes once with the device per log (``bitsparse.stats()``).

    Args (keyword only, besides the Trainer's own):
        bitsparse_options: keyword arguments for ``bitsparse.compressing()`` (``capacity``,
            ``sign_pack``, ``min_numel``, ...; see ``bitsparse.Options``). Default: none.
        bitsparse_log_stats: add the statistics to the logs (default True).

    Raises:
        TypeError, ValueError: from the constructor, for options ``compressing()`` refuses
            (see ``checked_options``), before the Trainer is built.
    """

    def __init__(
        self,
        *args: Any,
        bitsparse_options: Mapping[str, Any] | None = None,
        bitsparse_log_stats: bool = True,
        **kwargs: Any,
    ):
        self.bitsparse_options = checked_options(bitsparse_options)
        self.bitsparse_log_stats = bitsparse_log_stats
        self._bitsparse_reporter = StepReporter()
        super().__init__(*args, **kwargs)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The Trainer's own context (autocast and the like), then ``compressing()`` when
        gradients are enabled; both are entered now and left when the returned stack exits."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().compute_loss_context_manager())
            if torch.is_grad_enabled():
                stack.enter_context(bitsparse.compressing(**self.bitsparse_options))
            # Handed over entered: the caller's ``with`` leaves both (an error above leaves them here).
            return stack.pop_all()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with the BitSparse fields added when training stepped since
        the last log (and ``bitsparse_log_stats`` is set)."""
        if self.bitsparse_log_stats:
            logs.update(self._bitsparse_reporter.fields())
        return super().log(logs, *args, **kwargs)


class BitSparseTrainer(BitSparseTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training forwards run under ``bitsparse.compressing()``.

    Takes the Trainer's arguments and ``bitsparse_options`` and ``bitsparse_log_stats``
    (see ``BitSparseTrainerMixin``, which says how it meets gradient accumulation, evaluation,
    gradient checkpointing and logging).
    """


class BitSparseCallback(TrainerCallback):
    """Adds BitSparse's statistics (``bitsparse/...`` fields) to a Trainer's logs.

    For a plain ``Trainer`` that compresses by other means, e.g. ``bitsparse.enable()`` called
    in the thread that then calls ``trainer.train()`` (``BitSparseTrainer`` logs the fields
    itself, and this callback then does nothing). At each log made after new training steps it
    adds the fields to the ``logs`` dict, and to the matching ``state.log_history`` entry, which
    the Trainer records before its callbacks run. Callbacks that run before this one do not
    see them: the reporting callbacks that ``report_to`` adds (TensorBoard, W&B) come before
    the ones passed to the Trainer, so for those use ``BitSparseTrainer`` or the mixin.
    Reading the statistics synchronizes once with the device per log.
    """

    def __init__(self):
        self._reporter = StepReporter()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        """Add the fields to ``logs`` and to its ``state.log_history`` entry (see the class)."""
        if logs is None or any(key.startswith(PREFIX) for key in logs):
            return
        fields = self._reporter.fields()
        if not fields:
            return
        entry = state.log_history[-1] if state.log_history else None
        # Trainer.log appends a copy of ``logs`` (plus "step") before calling on_log.
        if entry is not None and entry.get("step") == state.global_step and logs.keys() <= entry.keys():
            entry.update(fields)
        logs.update(fields)
