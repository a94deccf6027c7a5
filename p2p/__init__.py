"""The swarm layer on libp2p: peer records, rounds, state transfer (docs/design.md has the map).

hivemind's package ``__init__`` imports all of hivemind: its averager, mixture-of-experts and
optimizers, and scipy with them — about 0.8 s of every node's start-up on two cores, for modules
p2p/ never uses. p2p/ uses hivemind's DHT, P2P and multiaddr modules, which import one another
by full name; so, unless something imported hivemind first, ``hivemind`` is registered here as a
bare package whose submodules load when imported. Elsewhere, import what you need from hivemind
by its full name (``from hivemind.averaging import DecentralizedAverager``), not as an attribute
of ``hivemind``."""

import importlib.util
import sys
import types


def _bare_hivemind() -> None:
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the first import that needs it says so
    package = types.ModuleType("hivemind")
    package.__spec__, package.__file__ = spec, spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = "hivemind"
    sys.modules["hivemind"] = package


_bare_hivemind()
