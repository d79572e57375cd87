"""What one running proxy holds: settings, metrics, the policy and its gate, the upstream
client, the estimator's state, routing, the requests in progress. Built by
``app.build_state``; read by the app and by each exchange."""

from __future__ import annotations

import logging
import math
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
        """Slicing auto: slice this held ticket on ``up`` rather than hold it? A hold is asked
        again once its predicted end has passed (the gate's wait), so a prediction that was
        wrong costs the prompt at most its own length again, not the wait bound."""
        choice = self.predictor.choose(up.name, ticket.tokens)
        if not choice.slice and 0 < choice.hold_s < self.predictor.wait_bound_s:
            ticket.recheck_at = self.policy.clock() + max(RECHECK_MIN_S, RECHECK_SLACK * choice.hold_s)
        if ticket.chosen is not choice.slice:  # log each change of mind once
            ticket.chosen = choice.slice
            log.info("large prefill #%d (%d tokens) on %s: %s (%s; %s, slice ~%.2f s)",
                     ticket.id, ticket.tokens, up.name, "slice" if choice.slice else "hold", choice.reason,
                     _hold_words(choice.hold_s, choice.finish_hold_s, self.predictor.wait_bound_s),
                     choice.finish_slice_s)
        return choice.slice


# A hold is decided again after its predicted wait times this (and at least this long).
RECHECK_SLACK = 1.25
RECHECK_MIN_S = 0.1


def _hold_words(hold_s: float, finish_s: float, bound_s: float) -> str:
    """What holding was predicted to cost, in words that stay finite."""
    if not math.isfinite(hold_s) or not math.isfinite(finish_s) or hold_s >= bound_s:
        return f"holding would wait past the wait bound ({bound_s:g} s)"
    return f"hold then prefill ~{finish_s:.2f} s"
