"""Transfer plans by peer engine layout, built off the event loop, one at a time, and kept (a few) for the next rank
of the same engine. A plan costs time in proportion to the peer's ranks (tens of ms for 64 decode ranks of a 60-layer
model, a third of a second for 256 on an idle core): built on the loop, one large claim would stall every peer wait
and heartbeat of the process."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from connector.core.layout import ModelLayout
from connector.core.plan import TransferPlan
from connector.protocol.handshake import layout_key, plan_between
from connector.protocol.messages import Hello


class PlanCache:
    def __init__(self, model: ModelLayout, own: Hello, max_plans: int = 8) -> None:
        """`own`: this rank's Hello (its side of every plan). `max_plans`: peer layouts kept (least recent go)."""
        self.model, self.own, self.max_plans = model, own, max_plans
        self._plans: OrderedDict[tuple, TransferPlan] = OrderedDict()
        self._one_at_a_time = asyncio.Lock()
        """One build at a time: a burst of claims costs one worker thread, not one per claim (each would take its
        share of the GIL from the loop)."""

    async def plan_for(self, peer: Hello) -> TransferPlan:
        """The plan between `peer`'s engine and ours (check `peer`'s sizes first:
        connector.protocol.handshake.check_peer_layout)."""
        key = (peer.role, *layout_key(peer))
        async with self._one_at_a_time:
            plan = self._plans.get(key)
            if plan is None:
                plan = await asyncio.to_thread(self._build, peer)
                self._plans[key] = plan
                while len(self._plans) > self.max_plans:
                    self._plans.popitem(last=False)
            self._plans.move_to_end(key)
            return plan

    def _build(self, peer: Hello) -> TransferPlan:
        plan = plan_between(peer, self.own, self.model)
        # the route indexes every registration reads, built here too rather than on the loop at first use
        plan.routes_from((0, 0)), plan.routes_to((0, 0))
        return plan
