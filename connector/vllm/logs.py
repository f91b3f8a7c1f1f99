"""The connector's log lines in vLLM's log, in vLLM's format.

vLLM configures only its own `vllm` logger (a handler with its format: process name, pid, level, time, file:line);
records of other packages' loggers go to the root logger, which vLLM leaves unconfigured, so `connector.*` INFO
lines never showed. Records of the `connector` loggers are handed to the handlers of the `vllm` logger, looked up
at each record, so a later reconfiguration of vLLM's logging (`--logging-config`) is followed too."""

from __future__ import annotations

import logging

VLLM_LOGGER = "vllm"
OUR_LOGGER = "connector"


class _ToVllmHandlers(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(VLLM_LOGGER).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def adopt_vllm_logging() -> None:
    """Route `connector.*` records through vLLM's handlers, at vLLM's level. Idempotent. Does nothing when vLLM
    configured no handler (VLLM_CONFIGURE_LOGGING=0): the application's own logging setup then applies."""
    ours, theirs = logging.getLogger(OUR_LOGGER), logging.getLogger(VLLM_LOGGER)
    if not theirs.handlers or any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # the root logger would print them a second time, unformatted
