"""The node's place in the swarm: libp2p daemon, Kademlia DHT and the live peer table.

Both run inside the node's own event loop (hivemind's ``DHTNode`` is plain
asyncio), so the only child process is ``p2pd``, started with
``PR_SET_PDEATHSIG`` so it dies with the node even after SIGKILL (``p2p/p2pd.py``).
``Swarm`` owns their lifecycle (``start``, ``close``), this peer's heartbeat and the
reading of the peer table; what one entry holds is ``p2p/peertable.py``'s.

Every peer announces itself under one DHT key per run (``gonka:<run>:peers``),
one subkey per peer id, refreshed every ``heartbeat_interval`` and expiring
after three intervals. That table is how peers count each other, find donors,
and compare ``params_hash`` after a round. Entries come from other peers and
are validated like any other message; ``p2p/records.py`` makes the DHT accept
an entry only when its owner signed it with its libp2p key.

A closed swarm (``p2p/membership.py``, enforced by ``p2p/admission.py``)
keeps outsiders out of the DHT: their ping, store and find calls are refused,
they never enter the routing table, and their entries are refused.
``Swarm.admits`` is the one check every request handler makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from typing import Any, Callable

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import get_dht_time
from hivemind.p2p import P2P, PeerID

from p2p.admission import Admission
from p2p.config import SwarmConfig
from p2p.limits import BoundedDict, StreamLimits
from p2p.identity import generate_identity
from p2p.membership import Membership
from p2p.p2pd import GatedP2P, children_die_with_us
from p2p.peertable import MAX_TABLE_ENTRIES, PeerRecord, parse_peer_record
from p2p.records import RecordSigner, RunRecordValidator, max_ttl, peer_table_key
from trainer.files import atomic_write
from trainer.fingerprint import Fingerprint

# How long p2pd may take to start and answer (a new process, its key, its listeners). Not a
# peer's request: request_timeout (5 s in the tests' settings) was too short for a node starting
# among a loaded machine's other processes ("Daemon failed to start in 5.0 seconds", 2026-12-06).
P2PD_STARTUP_SECONDS = 60.0

log = logging.getLogger(__name__)


class Swarm:
    """libp2p + DHT membership of one run. Create with ``await Swarm.start(...)``."""

    def __init__(self, config: SwarmConfig, run_id: str, p2p: P2P, dht: DHTNode | None,
                 on_reject: Callable[[str], None], *, membership: Membership):
        self.config = config
        self.run_id = run_id
        self.p2p = p2p
        self.dht = dht
        self.peer_id = p2p.peer_id.to_base58()
        self.maddrs: list[str] = []
        self._on_reject = on_reject
        self._key = peer_table_key(run_id)
        # Who may take part (open swarm: everyone), enforced by ``admission`` (p2p/admission.py).
        self.membership = membership
        self.admission = Admission(membership, p2p, run_id, self.reject, config.request_timeout)
        # This node's libp2p key (the one p2pd uses): signs heartbeats and whatever else it vouches for.
        self.signer: RecordSigner | None = None
        # Streams each peer has open to us, over every protocol (p2p/limits.py).
        self.streams = StreamLimits(config.max_streams_per_peer)
        self._me: dict[str, Any] = {"state": "joining", "round": 0, "hash": "", "step": 0, "loss": None, "rtok": 0}
        self._peers: dict[str, PeerRecord] = {}
        self._peers_at = 0.0
        # False after a failed lookup: the table may be stale, don't act on it alone.
        self.table_fresh = False
        self._heartbeat_task: asyncio.Task | None = None
        self._publish_now = asyncio.Event()
        self._logged_rejects: set[str] = set()
        # Peers met so far (bootstrap and table entries), for re-entering the DHT after a pause.
        self._known: dict[str, None] = {}
        # The records of the last lookups, each until its DHT expiration: peer -> (record, expiry).
        self._unexpired = BoundedDict(MAX_TABLE_ENTRIES)
        self._reconnected_at = 0.0
        # What this node trains; peers announcing another fingerprint are refused (``strangers``).
        self.fingerprint: Fingerprint | None = None
        self.strangers: dict[str, str] = {}  # peer id -> what differs, the most recent 64

    @classmethod
    async def start(
        cls, config: SwarmConfig, run_id: str, *, identity_path: str | None, on_reject: Callable[[str], None],
        fingerprint: Fingerprint | None = None, announce: bool = True,
    ) -> "Swarm":
        """Start p2pd and the DHT. With ``announce=False`` the node stays out of the peer table
        until ``set_fingerprint`` (a node still loading its model knows no fingerprint yet).

        Without ``identity_path`` the node gets an ephemeral key: heartbeats are signed with
        the key p2pd uses, so the node needs the key file either way. It is written (0600) to
        a private temporary directory, removed as soon as p2pd has read it. A closed swarm's
        settings that are unusable (allow-file, authority, this node's certificate) raise
        ValueError naming them."""
        identity_dir = None
        try:
            if identity_path is None:
                identity_dir = tempfile.TemporaryDirectory(prefix="gonka-identity-")  # mode 0700
                identity_path = os.path.join(identity_dir.name, "identity.key")
                key = generate_identity()
                atomic_write(identity_path, lambda f: f.write(key), overwrite=False)  # 0600
            signer = _signer(identity_path)
            membership = Membership.load(config, run_id, signer.peer_id, time.time())
            self = await cls._start_p2p(config, run_id, identity_path, on_reject, membership,
                                        check_identity=identity_dir is None)
        finally:
            if identity_dir is not None:
                identity_dir.cleanup()
        self.signer = signer
        try:
            await self._start_dht(signer)
        except BaseException:
            await self.p2p.shutdown()
            raise
        for addr in config.bootstrap:
            if "/p2p/" in addr:
                self._remember(addr.rsplit("/p2p/", 1)[-1])
        self.maddrs = [str(a) for a in await self.p2p.get_visible_maddrs()]
        self.fingerprint = fingerprint
        if membership.closed and not membership.own_cert and not config.allow and not config.allow_file:
            log.warning("closed swarm: this node has no membership certificate (--member-cert); "
                        "peers that do not list it will refuse it")
        if announce:
            await self._start_heartbeats()
        return self

    @classmethod
    async def _start_p2p(cls, config: SwarmConfig, run_id: str, identity_path: str, on_reject,
                         membership: Membership, *, check_identity: bool) -> "Swarm":
        nat = config.nat_traversal
        with children_die_with_us():
            p2p = await GatedP2P.create(
                initial_peers=config.bootstrap or None,
                host_maddrs=config.listen,
                announce_maddrs=config.announce or None,
                identity_path=identity_path,
                # A fresh ephemeral key is nobody else's: skip hivemind's probe for a duplicate.
                check_if_identity_free=check_identity,
                # docs/design.md network rules: no UPnP, AutoNAT, relays or IPFS unless asked for.
                nat_port_map=nat,
                auto_nat=nat,
                use_relay=nat,
                use_auto_relay=nat,
                use_ipfs=False,
                startup_timeout=max(config.request_timeout, P2PD_STARTUP_SECONDS),
            )
        return cls(config, run_id, p2p, None, on_reject, membership=membership)

    async def _start_dht(self, signer: RecordSigner) -> None:
        config = self.config
        await self.admission.start()
        if self.membership.closed:
            self.p2p.gate = self.admits
        validator = RunRecordValidator(self.run_id, signer, self.membership, max_ttl(config.heartbeat_interval),
                                       on_reject=self.reject)
        async with asyncio.timeout(config.request_timeout * 2):
            self.dht = await _create_dht(
                p2p=self.p2p,
                initial_peers=config.bootstrap or None,
                # One silent DHT peer must not use up a whole lookup's budget.
                wait_timeout=min(3.0, config.request_timeout / 2),
                bootstrap_timeout=config.request_timeout,
                cache_locally=False,
                # hivemind bans a peer that missed a reply, doubling the ban each time; a node
                # that was paused (SIGSTOP) then sees every peer banned and cannot read the table.
                blacklist_time=0,
                record_validator=validator,
            )
        if self.membership.closed:
            await self.admission.gate_routing_table(self.dht.protocol)

    async def set_fingerprint(self, fingerprint: Fingerprint) -> None:
        """Say what this node trains and start announcing it."""
        self.fingerprint = fingerprint
        if self._heartbeat_task is None:
            await self._start_heartbeats()

    async def _start_heartbeats(self) -> None:
        await self._publish()  # be in the peer table before asking anyone for anything
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    @property
    def scope(self) -> str:
        """Names this run's protocols: the run id and the fingerprint, so a peer that trains
        something else cannot even open a round or a state stream with this one."""
        return f"{self.run_id}.{self.fingerprint.digest[:16]}" if self.fingerprint is not None else self.run_id

    @property
    def p2pd_pid(self) -> int | None:
        child = getattr(self.p2p, "_child", None)
        return child.pid if child is not None else None

    # ---- what this peer announces -------------------------------------------------

    @property
    def round(self) -> int:
        """The round this peer last announced."""
        return int(self._me["round"])

    @property
    def observed(self) -> dict:
        """What our heartbeat says of our last round (``OBSERVED``, short keys)."""
        return dict(self._me.get("obs") or {})

    @property
    def state(self) -> str:
        """The state this peer last announced (``peertable.STATES``)."""
        return str(self._me["state"])

    def announce(self, **fields: Any) -> None:
        """Update this peer's heartbeat (state, round, hash, step, loss) and publish it soon."""
        self._me.update(fields)
        self._publish_now.set()

    async def _publish(self, ttl: float | None = None) -> None:
        value = dict(self._me, maddrs=self.maddrs)
        if self.fingerprint is not None:
            value.update(fp=self.fingerprint.digest, fpp=self.fingerprint.parts)
        ttl = ttl if ttl is not None else 3 * self.config.heartbeat_interval
        try:
            async with asyncio.timeout(self.config.request_timeout):
                await self.dht.store(self._key, value, get_dht_time() + ttl, subkey=self.peer_id)
        except Exception as e:  # a missed heartbeat is retried next interval
            log.debug("heartbeat store failed: %r", e)

    async def _heartbeat_loop(self) -> None:
        while True:
            if not len(self.dht.protocol.routing_table.uid_to_peer_id):
                await self.reconnect()
            await self._publish()
            self._publish_now.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_interval):
                    await self._publish_now.wait()

    def _remember(self, peer_id: str) -> None:
        self._known.pop(peer_id, None)
        self._known[peer_id] = None
        while len(self._known) > 64:
            del self._known[next(iter(self._known))]

    async def connect_to(self, peer: str) -> bool:
        """Dial ``peer`` at the addresses of its record in our table; False if it has none or fails."""
        record = self.peers.get(peer)
        if record is None or not record.maddrs:
            return False
        from hivemind.utils.multiaddr import Multiaddr

        try:
            # The transport part only: p2pd refuses an address that still ends in /p2p/<its id>.
            await self.p2p._client.connect(peer_id_from(peer), [Multiaddr(a.removesuffix(f"/p2p/{peer}"))
                                                                for a in record.maddrs])
            return True
        except Exception as e:
            log.debug("dialing %s at its addresses failed: %r", peer[-8:], e)
            return False

    async def reconnect(self) -> int:
        """Ping the peers we know into the DHT routing table again; returns how many answered.

        hivemind drops a peer from the routing table the first time it misses a reply. A
        node that was paused (SIGSTOP, a long GC or swap stall) sees all its requests time
        out at once when it resumes, and the others dropped it while it was silent: both
        sides then forget each other for good unless someone pings again."""
        if time.monotonic() - self._reconnected_at < self.config.heartbeat_interval:
            return 0
        self._reconnected_at = time.monotonic()
        candidates = [p for p in self._known if p != self.peer_id]
        if not candidates:
            return 0

        async def ping(peer: str):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.request_timeout):
                    return await self.dht.protocol.call_ping(peer_id_from(peer), strict=False)

        answered = sum(r is not None for r in await asyncio.gather(*(ping(p) for p in candidates)))
        if answered:
            log.info("re-entered the DHT: %d of %d known peers answered", answered, len(candidates))
        return answered

    async def leave(self) -> None:
        """Stop announcing and tell the swarm we are gone (a short-lived 'stopped' entry)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(self.config.request_timeout):
                    await self._heartbeat_task
            self._heartbeat_task = None
        self._me["state"] = "stopped"
        await self._publish(ttl=self.config.heartbeat_interval)

    async def close(self) -> None:
        """Leave and shut down DHT and p2pd; collects errors rather than stopping at the first."""
        errors = []
        self.admission.close()
        for step in (self.leave, self.dht.shutdown, self.p2p.shutdown):
            try:
                async with asyncio.timeout(self.config.request_timeout):
                    await step()
            except Exception as e:
                errors.append(e)
        if errors:
            log.warning("swarm shutdown: %s", "; ".join(repr(e) for e in errors))

    # ---- who may take part --------------------------------------------------------

    async def admits(self, peer_id: str, *, count: bool = True) -> bool:
        """Whether ``peer_id`` may take part in this run (``Admission.admits``): the check every
        handler of a peer's request makes first, with the authenticated remote peer id."""
        return await self.admission.admits(peer_id, count=count)

    def admitted(self, peer_id: str) -> bool:
        """``admits`` without a look-up and uncounted: what this node knows now. For pure checks
        that take a ``Callable[[str], bool]`` (e.g. who may sign a commit certificate)."""
        return self.admission.admitted(peer_id)

    # ---- what the swarm looks like ----------------------------------------------

    def reject(self, reason: str, detail: str = "") -> None:
        """Count a refused input from a peer; log each reason once."""
        self._on_reject(reason)
        if reason not in self._logged_rejects:
            self._logged_rejects.add(reason)
            log.warning("rejected input from a peer (%s) %s", reason, detail)

    async def refresh_peers(self, max_age: float = 0.0) -> dict[str, PeerRecord]:
        """Read the live peer table from the DHT (cached for ``max_age`` seconds). Excludes self."""
        if max_age and time.monotonic() - self._peers_at < max_age:
            return self._peers
        try:
            async with asyncio.timeout(self.config.request_timeout):
                found = await self.dht.get(self._key, latest=True)
        except Exception as e:
            log.debug("peer table lookup failed: %r", e)
            self.table_fresh = False
            await self.reconnect()
            return self._peers
        peers: dict[str, PeerRecord] = {}
        entries = found.value if found is not None else {}
        if not isinstance(entries, dict):
            self.reject("bad_peer_table")
            entries = {}
        if len(entries) > MAX_TABLE_ENTRIES:  # bounded whoever writes: the newest entries are kept
            self.reject("peer_table_full", f"{len(entries)} entries")
            newest = sorted(entries.items(), key=lambda kv: -getattr(kv[1], "expiration_time", 0.0))
            entries = dict(newest[:MAX_TABLE_ENTRIES])
        now = get_dht_time()
        for subkey, item in entries.items():
            if subkey == self.peer_id:
                continue
            try:
                record = parse_peer_record(subkey, getattr(item, "value", None))
            except ValueError as e:
                self.reject(str(e))
                continue
            admitted, why = self.membership.admits(record.peer_id, time.time())
            if not admitted:  # e.g. dropped from the allow-file since its entry was stored
                self.reject("not_admitted", f"{record.peer_id}: {why}")
                self._unexpired.pop(record.peer_id, None)
                continue
            if self._refused(record):
                self._unexpired.pop(record.peer_id, None)
                continue
            if record.state != "stopped":
                peers[record.peer_id] = record
                self._remember(record.peer_id)
                # Held no longer than a heartbeat's own life, whatever expiry its sender chose.
                expiry = min(float(getattr(item, "expiration_time", 0.0)), now + 3 * self.config.heartbeat_interval)
                self._unexpired[record.peer_id] = (record, expiry)
            else:
                self._unexpired.pop(record.peer_id, None)
        if not peers and self._known and await self.reconnect():
            return await self.refresh_peers()
        # A lookup can come back short (a DHT node that did not answer in time): a record that was
        # found before and has not expired is still the peer's word, as it is in the DHT itself.
        # Without this, one short lookup under load made a node see itself alone and lead alone.
        self._unexpired.retain(lambda p, kept: kept[1] > now)
        for peer, (record, _) in list(self._unexpired.items()):
            peers.setdefault(peer, record)
        self._peers, self._peers_at = peers, time.monotonic()
        self.table_fresh = True
        return peers

    def _refused(self, record: PeerRecord) -> bool:
        """A peer of this run id that trains something else: never counted, waited for or followed."""
        mine = self.fingerprint.digest if self.fingerprint is not None else ""
        if record.fingerprint == mine:
            return False
        if record.state == "stopped":
            return True
        first = record.peer_id not in self.strangers
        self.strangers.pop(record.peer_id, None)
        self.strangers[record.peer_id] = (self.fingerprint.difference(record.fingerprint_parts)
                                          if self.fingerprint is not None else "another run fingerprint")
        while len(self.strangers) > 64:
            del self.strangers[next(iter(self.strangers))]
        if first:
            self._on_reject("fingerprint_mismatch")
            log.warning("refusing peer %s: it trains another run under run id %r: %s", record.peer_id, self.run_id,
                        self.strangers[record.peer_id])
        return True

    @property
    def peers(self) -> dict[str, PeerRecord]:
        """The last peer table read (without self)."""
        return self._peers


def peer_id_from(text: str) -> PeerID:
    return PeerID.from_base58(text)


async def _create_dht(**kwargs) -> DHTNode:
    try:
        return await DHTNode.create(**kwargs)
    except RuntimeError as e:
        if "bootstrap failed" not in str(e):
            raise
        raise RuntimeError("none of the bootstrap peers answered (a closed swarm refuses peers it has not "
                           "admitted: ask its operator for a certificate or a place on its allow-list)") from None


def _signer(identity_path: str) -> RecordSigner:
    """The heartbeat signer of the key p2pd will use; ValueError naming node.identity if unusable."""
    try:
        with open(identity_path, "rb") as f:
            return RecordSigner.from_identity(f.read(64 * 1024))
    except Exception as e:  # unreadable, not protobuf, not an RSA key
        raise ValueError(f"node.identity: {identity_path}: not a usable libp2p key ({e})") from None
