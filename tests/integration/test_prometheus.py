"""promtool accepts the files shipped in docker/; the helpers tests/integration/test_operator.py
uses to run a real Prometheus against a live swarm and ask it every dashboard query and every
side of every alert rule."""

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
