"""What one running proxy holds: settings, metrics, the policy and its gate, the upstream
client, the estimator's state, routing, the requests in progress. Built by
``app.build_state``; read by the app and by each exchange."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .admission import AdmissionPolicy, Ticket, UpstreamState
from .auth import KeyCheck
from .bodies import BodyReader
from .capabilities import Capabilities
from .estimate import Estimator
from .gate import Gate
from .metrics import Metrics
from .predict import Predictor
from .relaycore import RelayFactory, python_relay
from .prefix_memory import PrefixMemory
from .routing import Routing
from .settings import Settings
from .upstream import UpstreamClient

log = logging.getLogger("prefill_gate")


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    policy: AdmissionPolicy
    gate: Gate
    client: UpstreamClient
    estimator: Estimator
    prefix_memory: PrefixMemory
    routing: Routing
    keys: KeyCheck | None = None
    exchanges: set = field(default_factory=set)  # requests in progress (relay.Exchange)
    predictor: Predictor | None = None
    bodies: BodyReader | None = None
    direct_relay: RelayFactory = python_relay  # the relay's read callbacks (relay_core)
    relay_core: str = "python"  # which: "compiled" or "python"
    gap_tally: type | None = None  # the compiled per-read token hook (relaycore.gap_tally_type), or None

    @property
    def health(self) -> dict[str, bool]:
        return self.routing.health

    @property
    def caps(self) -> dict[str, Capabilities]:
        return self.routing.caps

    def mark_health(self, upstream: str, healthy: bool) -> None:
        self.routing.mark_health(upstream, healthy)

    def set_capabilities(self, upstream: str, caps: Capabilities) -> None:
        self.routing.set_capabilities(upstream, caps)

    def pick_upstream(self) -> str:
        return self.routing.pick()

    def end_exchanges(self) -> int:
        """Shutdown's grace is over: end every request in progress with an error."""
        live = list(self.exchanges)
        for exchange in live:
            exchange.stop()
        return len(live)

    def choose_slice(self, ticket: Ticket, up: UpstreamState) -> bool:
        """Slicing auto: slice this held ticket on ``up`` rather than hold it?"""
        choice = self.predictor.choose(up.name, ticket.tokens)
        if ticket.chosen is not choice.slice:  # log each change of mind once
            ticket.chosen = choice.slice
            log.info("large prefill #%d (%d tokens) on %s: %s (%s; hold then prefill ~%.2f s, slice ~%.2f s)",
                     ticket.id, ticket.tokens, up.name, "slice" if choice.slice else "hold", choice.reason,
                     choice.finish_hold_s, choice.finish_slice_s)
        return choice.slice
