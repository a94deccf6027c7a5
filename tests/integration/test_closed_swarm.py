"""A closed swarm: two admitted nodes train together; an outsider gets nothing.

n1 holds a membership certificate from `gonka-node admit`; n2 is on n1's
allow-list (and admits n1 through the authority key). An outsider node that
bootstraps through them is refused at the DHT, and a plain hivemind DHT
node's direct store into the run's peer table is refused too.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import urllib.request

import pytest

from tests.integration.nodes import BIN, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = "closed"


def _cli(*args: str) -> str:
    out = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _metrics_url(node) -> str:
    return wait_until(lambda: re.search(r"^metrics on (\S+)", node.log(), re.M), 60, "metrics address").group(1)


def _not_admitted(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(r'^gonka_node_rejected_messages_total\{reason="not_admitted"\} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _outsider_store(maddr: str, peer_id: str) -> tuple:
    """A plain hivemind DHT node (no gonka code) stores a heartbeat straight into a member."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID, get_dht_time
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils import MSGPackSerializer

    p2p = await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False,
                           nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    node = None
    try:
        node = await DHTNode.create(p2p=p2p, wait_timeout=3)
        target, key = PeerID.from_base58(peer_id), DHTID.generate(source=f"gonka:{RUN}:peers")
        heartbeat = MSGPackSerializer.dumps({"state": "ready", "round": 10**6, "hash": "00"})
        stored = await node.protocol.call_store(target, keys=[key], values=[heartbeat],
                                                expiration_time=get_dht_time() + 30, subkeys=[p2p.peer_id.to_base58()])
        found = await node.protocol.call_find(target, [key])
        return stored, found
    finally:
        if node is not None:
            await node.shutdown()
        await p2p.shutdown()


def test_members_train_together_and_an_outsider_gets_nothing(nodes, tmp_path):
    public = _cli("admit", "--new-authority", str(tmp_path / "authority.key"))
    keys = {n: str(tmp_path / f"{n}.key") for n in ("n1", "n2")}
    ids = {n: _cli("identity", "--identity", k) for n, k in keys.items()}
    cert = tmp_path / "n1.cert"
    _cli("admit", "--authority-key", str(tmp_path / "authority.key"), "--peer", ids["n1"], "--run", RUN,
         "--days", "1", "--out", str(cert))
    common = ["--run-id", RUN, "--inner-steps", "4", "--min-peers", "2", "--swarm-authority", public,
              "--metrics-addr", "127.0.0.1:0"]
    n1 = nodes("n1", *common, "--identity", keys["n1"], "--member-cert", str(cert), "--allow", ids["n2"])
    n2 = nodes("n2", *common, "--identity", keys["n2"], "--bootstrap", n1.address())
    members = [n1, n2]
    for n in members:
        n.wait_round(2, timeout=120)
    urls = [_metrics_url(n) for n in members]
    assert all(_not_admitted(u) == 0 for u in urls)

    # An outsider on the same run id, bootstrapping through both members.
    outsider = nodes("out", "--run-id", RUN, "--inner-steps", "4", "--bootstrap", n1.address(),
                     "--bootstrap", n2.address())
    assert outsider.wait_exit(timeout=120) == 1
    assert "none of the bootstrap peers answered" in outsider.log()
    assert not outsider.rounds() and "reason=join" not in outsider.log()
    refused = [_not_admitted(u) for u in urls]
    assert all(r >= 1 for r in refused), refused

    # A plain hivemind DHT node's direct store into the run's key, and its read: both refused.
    stored, found = asyncio.run(asyncio.wait_for(_outsider_store(n1.address(), ids["n1"]), 60))
    assert stored is None and found is None
    assert _not_admitted(urls[0]) >= refused[0] + 2

    # The members kept training together; the table holds the two of them only.
    last = max(n1.rounds())
    for n in members:
        n.wait_round(last + 1, timeout=60)
    table = json.loads(_cli("peers", "--control", n2.control, "--json"))
    assert sorted(p["peer_id"] for p in table) == sorted(ids.values())
    for n in members:
        n.proc.send_signal(signal.SIGTERM)
    for n in members:
        assert n.wait_exit(timeout=60) == 0, n.log()[-3000:]
    r1, r2 = n1.rounds(), n2.rounds()
    common_rounds = set(r1) & set(r2)
    assert len(common_rounds) >= 2 and all(r1[r] == r2[r] for r in common_rounds), (r1, r2)
    assert "members=2" in n1.log() and "members=2" in n2.log()


def test_a_certificate_for_another_peer_exits_2_naming_the_setting(tmp_path):
    public = _cli("admit", "--new-authority", str(tmp_path / "authority.key"))
    other = _cli("identity", "--identity", str(tmp_path / "other.key"))
    cert = tmp_path / "other.cert"
    _cli("admit", "--authority-key", str(tmp_path / "authority.key"), "--peer", other, "--run", RUN,
         "--out", str(cert))
    out = subprocess.run([str(BIN), "start", "--run-id", RUN, "--metrics-addr", "off", "--control", "off",
                          "--model", "tiny", "--identity", str(tmp_path / "mine.key"), "--swarm-authority", public,
                          "--member-cert", str(cert)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("gonka-node: error:")]
    assert len(lines) == 1 and lines[0].startswith(f"gonka-node: error: swarm.member_cert: {cert}: issued to peer "
                                                   f"{other}"), out.stderr[-2000:]
