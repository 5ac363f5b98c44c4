"""What the framework integrations share: their options' check and the statistics they log."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import bitsparse
from bitsparse.hooks.stats import Stats

PREFIX = "bitsparse/"
"""Every logged name starts with it (TensorBoard groups the fields under it)."""
_MIB = 1 << 20


def checked_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` as keyword arguments for ``bitsparse.compressing()``/``enable()``, checked now.

    Raises:
        TypeError: ``options`` is not a mapping, or names an option ``compressing()`` does not
            take, or gives one a value of the wrong type.
        ValueError: an option's value is out of range, or its backend cannot run here.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"BitSparse options must be a mapping of compressing()'s options, got {type(options).__name__}")
    known = [f.name for f in dataclasses.fields(bitsparse.Options)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unknown BitSparse option(s) {unknown}; compressing() takes {known}")
    bitsparse.Options(**options)  # the checks compressing() makes, before any training runs
    return dict(options)


def log_fields(stats: Stats) -> dict[str, float | int]:
    """``stats`` as flat scalars for a logger, named ``bitsparse/<field>``.

    The fields: ``compression_ratio`` (dense over stored bytes of the compressed tensors),
    ``dense_mib`` and ``stored_mib`` (their sizes in MiB), ``tensors_compressed``,
    ``fallbacks`` (tensors that were to be compressed and were kept dense, all reasons
    together: on the first step, which only measures, every candidate) and ``zero_fraction``.
    """
    return {
        f"{PREFIX}compression_ratio": stats.ratio,
        f"{PREFIX}dense_mib": stats.dense_bytes / _MIB,
        f"{PREFIX}stored_mib": stats.stored_bytes / _MIB,
        f"{PREFIX}tensors_compressed": stats.tensors_compressed,
        f"{PREFIX}fallbacks": sum(stats.fallbacks.values()),
        f"{PREFIX}zero_fraction": stats.zero_fraction,
    }


class StepReporter:
    """Reads ``bitsparse.stats()`` for a log, and reports each BitSparse step at most once.

    A BitSparse step is one forward and its backward (with gradient accumulation, one
    micro-batch), so the fields describe the last one before the log.
    """

    def __init__(self):
        self._last_step: int | None = None

    def fields(self) -> dict[str, float | int]:
        """``log_fields`` of the current or last finished step, or ``{}`` when that step saved
        nothing or was already reported (a log after evaluation, or the end-of-training summary).

        Synchronizes once with the device (``bitsparse.stats()``).
        """
        stats = bitsparse.stats()
        if stats.tensors_seen == 0 or stats.step == self._last_step:
            return {}
        self._last_step = stats.step
        return log_fields(stats)
