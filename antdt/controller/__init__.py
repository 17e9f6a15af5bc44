"""The straggler controller (AntDT's Controller): a mechanism plus small policies, in the manner of
:mod:`distributed.active_memory_manager`.

```
 every tick:  Monitor.update ──► Tick (ledger, verdicts, leases) ──► policy.run(tick) yields actions
                                                                            │
    ledger.revoke / split / pace, retire(worker), batch size  ◄── resolve conflicts, apply
                                                                            │
                                    log + Dask event (topic "antdt") + record (count, records)
```

Actions are typed (:class:`Reassign`, :class:`Split`, :class:`Revoke`, :class:`Retire`,
:class:`Pace`, :class:`AdjustBatch`), each with its :class:`Evidence`. The mechanism resolves conflicts before
applying anything:

* one action per lease per tick; the strongest wins (``Revoke`` > ``Reassign`` > ``Split``, then
  the first yielded), so a lease being revoked is never split;
* no lease action for a worker retired in the same tick (retirement requeues its rows anyway);
* retirement never leaves the job fewer than ``min_workers`` of its own workers (``workers()``:
  those its agents train on, less the workers whose retirement is under way);
* an action with nothing to move (the lease ended, was revoked, or has no unclaimed rows) is
  dropped, not recorded.

Jobs share a cluster: a job's controller acts on its own agents only. Where another job trains
on a worker it would retire, :class:`ControllerService` stops this job's agent there instead of
closing the worker (its master's :class:`JobAgents`), and the record's reason says so.

Only unclaimed rows move (the ledger's exactly-once rule), so every action is safe to apply at any
time. Built-in policies (the defaults under ``antdt.controller.policies``, in this order):
:class:`RevokeHung`, :class:`RetireHung`, :class:`ReassignStragglers`, :class:`PaceStragglers`,
:class:`SplitTail`.
Opt-in: :class:`RetirePersistent` (in the asynchronous mode retiring a persistent straggler only
gives up its share unless a cluster manager replaces it) and :class:`BalanceBatch` (synchronous
mode). A user policy is a :class:`ControllerPolicy` subclass named by dotted path in dask
config::

    antdt:
      controller:
        policies:
          - class: mypackage.policies.MyPolicy
            threshold: 3

=================================  ==============================================================
:mod:`antdt.controller.actions`    the typed actions, their evidence, the applied record
:mod:`antdt.controller.policies`   :class:`Tick` (what a policy sees) and the built-in policies
:mod:`antdt.controller.mechanism`  :class:`Controller`: a plain class (injected clock, no Dask)
                                   driven by the simulator and the tests
:mod:`antdt.controller.service`    :class:`ControllerService`: one controller per job on the
                                   scheduler, next to the sharding service
=================================  ==============================================================
"""

from __future__ import annotations

from antdt.controller.actions import (ACTION_NAMES, Action, ActionRecord, AdjustBatch, Evidence,
                                      LeaseAction, Pace, Reassign, Retire, Revoke, Split)
from antdt.controller.mechanism import Controller
from antdt.controller.policies import (BalanceBatch, ControllerPolicy, PaceStragglers,
                                       ReassignStragglers, RetireHung, RetirePersistent,
                                       RevokeHung, SplitTail, Tick, load_policies)
from antdt.controller.service import (EVENT_TOPIC, PLUGIN_NAME, ControllerService, JobAgents,
                                      enable_controller)

__all__ = [
    "ACTION_NAMES", "EVENT_TOPIC", "PLUGIN_NAME", "Action", "ActionRecord", "AdjustBatch",
    "BalanceBatch", "Controller", "ControllerPolicy", "ControllerService", "Evidence",
    "JobAgents", "LeaseAction", "Pace", "PaceStragglers", "Reassign", "ReassignStragglers",
    "Retire", "RetireHung", "RetirePersistent", "Revoke", "RevokeHung", "Split", "SplitTail",
    "Tick", "enable_controller", "load_policies",
]
