"""docker/compose.yml and what it mounts, checked without docker: two nodes (the second
bootstrapping from the first), Prometheus with the alert rules, Grafana provisioned with the
Prometheus datasource the dashboard names."""

import json
import os

import pytest
import yaml

from tests.unit.test_cli import ROOT

pytestmark = pytest.mark.timeout(30)
DOCKER = os.path.join(ROOT, "docker")


def compose() -> dict:
    return yaml.safe_load(open(os.path.join(DOCKER, "compose.yml")))


def test_two_nodes_the_second_joining_the_first_and_prometheus_and_grafana():
    services = compose()["services"]
    assert set(services) == {"node1", "node2", "prometheus", "grafana"}
    assert "--bootstrap" not in services["node1"]["command"]
    joining = " ".join(services["node2"]["entrypoint"])
    assert "--bootstrap /dns4/node1/tcp/31337/p2p/" in joining and "exec gonka-node start" in joining
    for name in ("node1", "node2"):  # identity and checkpoints on the node's own volume
        assert "/data/identity.key" in str(services[name]) and "/data/checkpoints" in str(services[name])
        assert f"{name}-data:/data" in services[name]["volumes"]
    targets = yaml.safe_load(open(os.path.join(DOCKER, "prometheus.yml")))["scrape_configs"][0]["static_configs"][0]
    assert sorted(targets["targets"]) == ["node1:9400", "node2:9400"]


def test_the_nodes_tcp_buffers_cover_a_distant_gigabit_link():
    from p2p.tcpsettings import ADVISED

    for name in ("node1", "node2"):
        assert compose()["services"][name]["sysctls"] == ADVISED, name


def test_every_mounted_file_exists_and_grafana_has_the_dashboards_datasource():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert os.path.exists(os.path.join(DOCKER, source)), (name, volume)
    sources = yaml.safe_load(open(os.path.join(DOCKER, "grafana", "provisioning", "datasources", "prometheus.yml")))
    uids = {d["uid"] for d in sources["datasources"] if d["type"] == "prometheus"}
    dash = json.load(open(os.path.join(DOCKER, "grafana", "dashboards", "gonka-node.json")))
    assert {p["datasource"]["uid"] for p in dash["panels"]} <= uids
    assert len(dash["panels"]) >= 12 and all(p["targets"] for p in dash["panels"])
