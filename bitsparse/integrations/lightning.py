"""BitSparse for Lightning: a callback that compresses what training steps save for backward.

    from bitsparse.integrations.lightning import BitSparseCallback

    trainer = lightning.Trainer(callbacks=[BitSparseCallback()])   # options as for compressing()
    trainer.fit(model, data)

Needs ``lightning`` (``pip install -e ".[lightning]"``).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback

import bitsparse
from bitsparse.integrations.common import StepReporter, checked_options

__all__ = ["BitSparseCallback"]


class BitSparseCallback(Callback):
    """Enables BitSparse for each training batch, and logs its statistics.

    ``bitsparse.enable(**options)`` at ``on_train_batch_start`` and ``bitsparse.disable()`` at
    ``on_train_batch_end``, so the batch's forward passes (``training_step``, and every closure
    call of an optimizer that makes several) store their ReLU-family activations compressed,
    and backward restores them bit for bit: losses, gradients and weights are identical to a
    run without the callback. Validation, testing and prediction run outside that window
    (under ``torch.no_grad()``, where nothing is saved anyway). Saved-tensor hooks are
    thread-local, and Lightning calls these hooks in the thread that runs the training step.

    BitSparse is also disabled at the end of each training epoch (a ``LightningModule`` whose
    ``on_train_batch_start`` returns -1 ends the epoch without ``on_train_batch_end``), in
    ``on_exception`` (a failed step leaves no hooks installed, and the library keeps working)
    and at ``teardown``.

    With ``log_stats`` (default), ``on_train_batch_end`` logs ``bitsparse/...`` fields
    (``bitsparse.integrations.common.log_fields``: compression ratio, dense and stored MiB,
    tensors compressed, fallbacks, zero fraction) with ``pl_module.log(..., on_step=True,
    on_epoch=False)``; they describe the batch just trained (its last forward and backward).
    Reading them synchronizes once with the device per batch (``bitsparse.stats()``).

    Args:
        log_stats: log the statistics (keyword only).
        **options: keyword arguments for ``bitsparse.enable()`` (``capacity``, ``sign_pack``,
            ``min_numel``, ...; see ``bitsparse.Options``).

    Raises:
        TypeError, ValueError: from the constructor, for options ``enable()`` refuses.
        RuntimeError: at a training batch's start, when BitSparse is already enabled in the
            thread by something else (``bitsparse.enable()``: use one or the other), or when
            ``trainer.fit`` runs inside ``compressing()`` or another ``saved_tensors_hooks``
            block (from ``bitsparse.enable()``).
    """

    def __init__(self, *, log_stats: bool = True, **options: Any):
        self.options = checked_options(options)
        self.log_stats = log_stats
        self._reporter = StepReporter()
        self._enabled_here = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Enable BitSparse for this batch (see the class for the errors)."""
        if bitsparse.is_enabled() and not self._enabled_here:
            raise RuntimeError(
                "BitSparseCallback enables BitSparse for each training batch, but bitsparse.enable() is already in "
                "effect in this thread: use the callback or enable(), not both"
            )
        bitsparse.enable(**self.options)
        self._enabled_here = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Disable BitSparse, and log this batch's statistics (with ``log_stats``)."""
        self._disable()
        if self.log_stats:
            fields = self._reporter.fields()
            if fields:
                pl_module.log_dict({k: float(v) for k, v in fields.items()}, on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Disable BitSparse if a batch was cut short (see the class)."""
        self._disable()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Disable BitSparse after a failed step, without hiding the step's exception."""
        try:
            self._disable()
        except RuntimeError as error:  # another hooks block is still open: report, do not mask
            warnings.warn(f"BitSparseCallback could not disable BitSparse after {exception!r}: {error}", RuntimeWarning)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Disable BitSparse if it is still enabled (the end of fit, or of a failed fit)."""
        self._disable()

    def _disable(self) -> None:
        if self._enabled_here:
            bitsparse.disable()
            self._enabled_here = False
