"""How the node's log lines look: text for people, or one JSON object per line for log shippers."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    and ``exception`` (the traceback) when there is one. A message never spans lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    """Log to stderr at ``level`` in ``fmt`` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if fmt == "json":  # hivemind (and the p2pd lines it relays) through our handler, not its own
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
