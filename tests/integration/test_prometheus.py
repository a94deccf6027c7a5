"""A real Prometheus (Debian's `prometheus`) scraping a live 2-node swarm: the dashboard's
every query and every alert rule's every side return data, and promtool accepts the files
shipped in docker/."""

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.integration.nodes import wait_until
from tests.unit.test_cli import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                 reason="Debian's prometheus is not installed (scripts/setup installs it when root)")]

DOCKER = os.path.join(ROOT, "docker")
DASHBOARD = os.path.join(DOCKER, "grafana", "dashboards", "gonka-node.json")
ALERTS = os.path.join(DOCKER, "alerts.yml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_queries() -> list[str]:
    dash = json.load(open(DASHBOARD))
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def alert_sides() -> list[str]:
    """Each side of every alert rule's top-level comparison that is not a plain number: a rule
    watches what they return, so each must return data on a live swarm."""
    sides = []
    for group in yaml.safe_load(open(ALERTS))["groups"]:
        for rule in group["rules"]:
            expr, depth, cut = rule["expr"], 0, None
            for i, ch in enumerate(expr):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0 and expr[i:i + 3].strip() in ("==", "<", ">", "<=", ">=", "!=") and expr[i] == " ":
                    cut = i
            assert cut is not None, rule
            op = re.match(r"\s*(==|!=|<=|>=|<|>)", expr[cut:])
            sides += [s.strip() for s in (expr[:cut], expr[cut + op.end():])
                      if not re.fullmatch(r"\s*[\d.]+\s*", s)]
    return sides


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_promtool_accepts_the_shipped_config_and_rules(tmp_path):
    # The compose file's config names the rules where the container mounts them; check it here.
    config = yaml.safe_load(open(os.path.join(DOCKER, "prometheus.yml")))
    config["rule_files"] = [ALERTS]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    for args in (["check", "config", str(tmp_path / "prometheus.yml")], ["check", "rules", ALERTS]):
        result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_a_real_prometheus_scrapes_a_live_swarm_and_every_query_returns_data(nodes, tmp_path):
    ports = [free_port(), free_port()]
    a = nodes("a", "--inner-steps", "3", "--min-peers", "2", "--metrics-addr", f"127.0.0.1:{ports[0]}",
              "--checkpoint-dir", str(tmp_path / "ckpt-a"), "--set", "data.eval_every=1")
    b = nodes("b", "--inner-steps", "3", "--min-peers", "2", "--metrics-addr", f"127.0.0.1:{ports[1]}",
              "--checkpoint-dir", str(tmp_path / "ckpt-b"), "--set", "data.eval_every=1", "--bootstrap", a.address())
    web = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [ALERTS],
              "scrape_configs": [{"job_name": "gonka-node",
                                  "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{web}"
    try:
        for n in (a, b):
            n.wait_round(3, timeout=150)

        def rounds_seen():
            try:
                return len([r for r in query(base, "gonka_node_rounds_total > 0")]) == 2
            except OSError:
                return False

        wait_until(rounds_seen, 90, "Prometheus to see rounds on both nodes")
        # Rates need two samples of a committed round in their window: a few more scrapes.
        wait_until(lambda: len(query(base, "rate(gonka_node_rounds_total[5m]) > 0")) == 2, 60, "round rates")
        empty = [expr for expr in [*dashboard_queries(), *alert_sides()] if not query(base, expr)]
        assert not empty, f"queries returning nothing on a live swarm: {empty}"
        rules = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10).read())
        loaded = [r for g in rules["data"]["groups"] for r in g["rules"]]
        assert len(loaded) == 5 and all(r["health"] == "ok" for r in loaded), loaded
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()
