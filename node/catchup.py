"""Catching up from the rounds' averages (p2p/averagelog.py): a peer whose state download
outlasted the swarm's rounds, or that was left out of a few, takes the missed rounds' outer steps
itself instead of downloading the state again; each must land on its certificate's hash.
``TrainingLoop`` (node/loop.py) calls it while it re-syncs."""

from __future__ import annotations

import logging
import math

from p2p.averagelog import RoundAverage
from p2p.compression import CommittedAverage
from p2p.snapshot import Snapshot, state_bytes
from p2p.transfer import NoChain, StateDownload
from p2p.wire import WireError

log = logging.getLogger("gonka.node")


async def catch_up(loop, download: StateDownload, target: int, target_hash: str, donors: list[str], *,
               snap: Snapshot | None = None) -> int:
    """The rounds the swarm committed after our state, up to ``target`` (during a download of
    ``snap``, or while we were left out), taken from their averages (p2p/averagelog.py)
    instead of downloading the state again; how many: none if the averages would be as
    many bytes as the state, or a multi-rank host (its donors keep none).

    Each outer step must land on the ``params_hash`` of its round's certificate. If one does
    not (donors that agree on wrong bytes), ``snap`` is loaded again (without one, the state
    is left for the download that follows to replace) and the caller's re-sync goes on as
    before: a download of the newest state."""
    if hasattr(loop.worker, "load_shards") or target <= loop.worker.round:
        return 0
    from p2p.codecs import get_codec

    codec = get_codec(loop.swarm.config.codec).average  # the averages' format (a sparse codec's own)
    numel = sum(math.prod(s) for s in loop.worker.state_shapes())
    # Worth it while the averages are fewer bytes than the state (8 a parameter): up to 7
    # rounds with int8, 15 with the 4-bit codecs, 1 with fp32.
    if (target - loop.worker.round) * codec.wire_bytes(numel) >= state_bytes(loop.worker.state_shapes()):
        log.info("catch-up: %d rounds behind; the state is fewer bytes", target - loop.worker.round)
        return 0
    try:
        chain = await download.fetch_chain(target, target_hash, donors, loop.rounds.commits)
    except NoChain as e:
        log.info("catch-up: %s", e)
        return 0
    certs, done = {c.round: c for c in chain}, 0
    while loop.worker.round < target and not loop.stop_requested.is_set():
        cert = certs.get(loop.worker.round + 1)
        if cert is None or cert.prev != loop.status.params_hash:
            break
        try:
            avg = await download.average(cert.round, cert.prev, cert.new, donors, numel, codec)
        except (RuntimeError, WireError) as e:
            log.info("catch-up: %s", e)
            break
        if not await loop.compute(step_verified, loop.worker, avg, codec, snap):
            loop.swarm.reject("bad_average", f"round {cert.round} from {len(donors)} donors")
            loop.server.averages.clear()
            if snap is not None:
                loop.rounds.commits.hold(snap.round, snap.params_hash)
                await loop.publish_state()
            return 0
        loop.rounds.commits.adopt(chain, cert.round, cert.new)
        loop.server.averages.add(avg)  # verified: ours to serve as well
        loop.metrics.caught_up_rounds.inc()
        loop.metrics.round.set(loop.worker.round)
        await loop.publish_state()
        done += 1
    if done:
        log.info("caught up %d rounds from their averages, now at round=%d hash=%s", done, loop.worker.round,
                 loop.status.params_hash)
    return done


def step_verified(worker, avg: RoundAverage, codec, snap: Snapshot | None) -> bool:
    """The outer step of a downloaded average; False (and ``snap`` loaded again) unless it
    gives the hash its round's certificate names."""
    worker.apply_outer(CommittedAverage(codec, avg.pieces, list(avg.payloads), worker.global_params))
    if worker.params_hash() == avg.new:
        return True
    log.warning("the average of round %d does not give %s", avg.round, avg.new[:12])
    if snap is not None:
        worker.load_global_state(snap.unpack())
    return False
