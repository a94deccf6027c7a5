"""Poll one node's Prometheus endpoint and append what the ``utilization`` benchmark needs to a JSONL file.

Runs inside the node's testbed namespace (``Testbed.run``), since the node
serves its metrics on its testbed address. One line per successful scrape:
``{"t": unix time, "m": {metric: value}}``. Exits once the node has been
gone for ``GONE_AFTER`` seconds after answering at least once, or at
``timeout``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

KEEP = ("gonka_node_inner_steps_total", "gonka_node_inner_step_seconds_sum", "gonka_node_inner_step_seconds_count",
        "gonka_node_rounds_total", "gonka_node_gather_wait_seconds_sum", "gonka_node_gather_wait_seconds_count",
        "gonka_node_allreduce_seconds_sum", "gonka_node_allreduce_seconds_count", "gonka_node_sent_bytes_total",
        "gonka_node_state_download_seconds_sum")
GONE_AFTER = 3.0


def main(url: str, out: str, interval: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_ok = None
    with open(out, "a") as f:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                if last_ok is not None and time.monotonic() - last_ok > GONE_AFTER:
                    return
                time.sleep(interval)
                continue
            last_ok = time.monotonic()
            values = {}
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name in KEEP:
                    values[name] = float(value)
            f.write(json.dumps({"t": time.time(), "m": values}) + "\n")
            f.flush()
            time.sleep(interval)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
