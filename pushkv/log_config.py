"""vLLM's ``--log-config-file`` (its ``VLLM_LOGGING_CONFIG_PATH``): a JSON object in ``logging.config.dictConfig``'s
schema that each process applies in place of its own logging setup, authoritative over loggers, handlers, formats
and levels, as vLLM's custom config is over its default one.

``pushkv up`` reads the file once (``read``: a missing file, or JSON that is not an object, is refused before
anything starts, as vLLM refuses them) and the text travels in the deployment's config, so every process of every
host applies the same (``apply``), and the supervisor applies it first, so a config ``dictConfig`` refuses stops
the deployment before any child starts. Unless the file says otherwise, the loggers that exist when it is applied
(every module's, from the process's imports) stay enabled: dictConfig's default ``disable_existing_loggers`` would
silence them."""
from __future__ import annotations

import json
import logging.config


def read(path: str, given: str = "--log-config-file") -> str:
    """The file's dictConfig object, as JSON text; ValueError naming the file (and ``given``, where it was given)
    where it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{given} {path}: {e.strerror or e}") from None
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{given} {path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{given} {path}: a JSON object in logging.config.dictConfig's schema, not "
                         f"{type(config).__name__}")
    if "version" not in config:
        raise ValueError(f"{given} {path}: dictConfig needs \"version\": 1")
    return json.dumps(config)


def apply(text: str) -> None:
    """Configure this process's logging from ``read``'s text; ValueError where dictConfig refuses it (a handler's
    class that does not import, a file it cannot open), naming what it could not configure."""
    config = json.loads(text)
    # a process's loggers exist from its imports, before this runs: dictConfig's default would silence them all
    config.setdefault("disable_existing_loggers", False)
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise ValueError(f"--log-config-file: logging.config.dictConfig refused it: {e}") from None
