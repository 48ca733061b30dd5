"""vLLM's warnings about what the engine does on purpose, dropped while it does it."""

from __future__ import annotations

import logging
from contextlib import contextmanager


@contextmanager
def _quiet(logger_names: tuple[str, ...], expected: tuple[str, ...]):
    """Drops the log records of `logger_names` that hold one of the `expected` phrases."""
    quiet = logging.Filter()
    quiet.filter = lambda record: not any(e in str(record.msg) for e in expected)
    loggers = [logging.getLogger(name) for name in logger_names]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def quiet_partial_reload():
    """vLLM warns about every layer a reload leaves out: expected for one bucket of a sync."""
    return _quiet(tuple(f"vllm.model_executor.model_loader.reload.{m}" for m in ("layerwise", "inplace")),
                  ("Failed to load weights", "weights were not loaded from checkpoint"))


def quiet_encoder_reset():
    """vLLM warns that dropping the encoder cache under running requests may desync its media
    caches; the caches it means (the processor's) are not touched by it, so nothing desyncs."""
    return _quiet(("vllm.v1.engine.core",), ("Resetting the encoder cache",))
