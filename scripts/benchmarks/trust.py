"""Benchmark ``trust``: what owner-bound heartbeats and membership certificates cost.

Every heartbeat a node publishes is signed with its libp2p RSA key
(``RunRecordValidator.sign_value``), and every peer-table entry a DHT node
stores or a lookup returns is checked (``validate``). Rows, medians over
``--repeats`` calls of a realistic heartbeat (the fields ``Swarm`` announces,
fingerprint parts included):

- ``sign``: one heartbeat signed (RSA-2048, PKCS#1 v1.5, SHA-256);
- ``verify_first``: an entry from a peer never seen (public key parsed, signature checked);
- ``verify_known_key``: a new entry of a known peer (signature checked);
- ``verify_repeat``: the same entry again, as lookups return it from several
  nodes (digest found in the cache of verified records);
- ``cert_check``: a membership certificate learned (Ed25519 verify);
- ``table_read_N``: checking a lookup result of N entries, all new, keys known
  (what one ``refresh_peers`` costs per DHT node that answered, at worst).

``bytes`` is the size of a heartbeat before and after signing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from p2p.identity import generate_identity
from p2p.membership import Membership, issue_cert, load_authority_key, new_authority
from p2p.records import RecordSigner, RunRecordValidator, max_ttl, peer_table_key
from trainer.fingerprint import PART_NAMES

from .options import positive_int

RUN = "bench"
COLUMNS = ["operation", "median_us", "p90_us", "per_second", "bytes"]


def add_arguments(group) -> None:
    group.add_argument("--repeats", type=positive_int,
                       help="timed calls per row (default 500; 50 with --quick, 5 with --smoke)")
    group.add_argument("--table", type=positive_int, help="entries of the table_read row (default 100; 8 with --smoke)")


def heartbeat(i: int) -> dict:
    """What Swarm._publish announces, with typical sizes."""
    return {"state": "training", "round": 1234 + i, "hash": "ab" * 32, "step": 40_000 + i, "loss": 2.71828,
            "rtok": 1_000_000 + i, "maddrs": ["/ip4/203.0.113.7/tcp/31337"], "fp": "cd" * 32,
            "fpp": {name: "ef" * 8 for name in PART_NAMES}}


def _timed(fn, repeats: int) -> list[float]:
    fn(0)  # warm-up
    out = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, seconds: list[float], size: int | str = "") -> dict:
    median = statistics.median(seconds)
    p90 = sorted(seconds)[int(0.9 * (len(seconds) - 1))]
    return {"operation": name, "median_us": median * 1e6, "p90_us": p90 * 1e6, "per_second": 1 / median,
            "bytes": size, "all_us": [round(s * 1e6, 1) for s in seconds]}


def run(args) -> dict:
    smoke = getattr(args, "smoke", False)
    repeats = args.repeats or (5 if smoke else 50 if args.quick else 500)
    now = time.time()
    key = DHTID.generate(source=peer_table_key(RUN)).to_bytes()
    owners = [RecordSigner.from_identity(generate_identity()) for _ in range(2)]
    me, owner = owners
    ttl = max_ttl(2.0)

    def validator() -> RunRecordValidator:
        return RunRecordValidator(RUN, me, Membership(RUN, closed=False, peer_id=me.peer_id), ttl)

    signing = RunRecordValidator(RUN, owner, Membership(RUN, closed=False, peer_id=owner.peer_id), ttl)

    def record(i: int) -> DHTRecord:
        value = MSGPackSerializer.dumps(heartbeat(i))
        return DHTRecord(key, MSGPackSerializer.dumps(owner.peer_id), value, now + 6 + i * 1e-6)

    def signed(i: int) -> DHTRecord:
        r = record(i)
        return dataclasses.replace(r, value=signing.sign_value(r))

    plain_size, signed_size = len(record(0).value), len(signed(0).value)
    records = [signed(i) for i in range(repeats + 1)]
    rows = [_row("sign", _timed(lambda i: signing.sign_value(record(i)), repeats), f"{plain_size}->{signed_size}")]

    fresh = [validator() for _ in range(repeats + 1)]
    rows.append(_row("verify_first", _timed(lambda i: fresh[i].validate(records[i]), repeats)))
    known = validator()
    rows.append(_row("verify_known_key", _timed(lambda i: known.validate(records[i]), repeats)))
    rows.append(_row("verify_repeat", _timed(lambda i: known.validate(records[i]), repeats)))
    assert all(known.validate(r) for r in records)

    pem, public = new_authority()
    authority = load_authority_key(pem)
    # One peer's certificates, each lasting a second longer: every one is new, so checked.
    certs = [issue_cert(authority, RUN, owner.peer_id, int(now) - 60, int(now) + 3600 + i)
             for i in range(repeats + 1)]
    members = Membership(RUN, closed=True, peer_id=me.peer_id, authority=authority.public_key())
    rows.append(_row("cert_check", _timed(lambda i: members.learn_cert(certs[i], now), repeats),
                     len(certs[0])))

    n = args.table or (8 if smoke else 100)  # one RSA key each: ~0.1 s to make
    signers = [RecordSigner.from_identity(generate_identity()) for _ in range(n)]
    table_validator = validator()
    batches = []
    for b in range(max(3, min(repeats, 20)) + 1):
        batch = []
        for s in signers:
            r = DHTRecord(key, MSGPackSerializer.dumps(s.peer_id), MSGPackSerializer.dumps(heartbeat(b)),
                          now + 6 + b * 1e-6)
            v = RunRecordValidator(RUN, s, Membership(RUN, closed=False, peer_id=s.peer_id), ttl)
            batch.append(dataclasses.replace(r, value=v.sign_value(r)))
        batches.append(batch)
    rows.append(_row(f"table_read_{n}", _timed(lambda i: all(map(table_validator.validate, batches[i])),
                                               len(batches) - 1)))
    beat = rows[0]["median_us"] + rows[2]["median_us"]
    return {"rows": rows, "columns": COLUMNS, "repeats": repeats, "authority": public,
            "notes": [f"per heartbeat: sign {rows[0]['median_us']:.0f} us once, verify {rows[2]['median_us']:.0f} us "
                      f"per storing node ({beat:.0f} us together); {signed_size - plain_size} bytes added"]}
