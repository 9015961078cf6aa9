"""The kube-scheduler extender: filter, prioritize, bind and preempt over HTTP with GPU-level
accounting (``gpuslice extender``, one Deployment beside kube-scheduler).

kube-scheduler only counts extended resources per node. The extender decides per GPU: filter
drops nodes where no GPU (or not enough GPUs) has the share a pod asks for, with a reason per
node; prioritize scores the rest 0..10 with a core placement policy; bind chooses the GPUs,
takes them in the ledger (a compare-and-swap of an immutable value, no node-wide lock) and
creates the Binding with the signed assignment on it (one write, the pod's UID and
resourceVersion as preconditions); preempt checks the scheduler's victims on the GPU side.
Everything is rebuilt from the API server on start, the ledger from the assignments of live
pods, so a restart loses nothing and doubles nothing.

- :mod:`.state`: the inventory, the ledger and the verbs' decisions (over :mod:`.view`, with
  :mod:`.inventory`, :mod:`.mig`, :mod:`.placement` and :mod:`.preemption`);
- :mod:`.requeue`: a pod the filter refused, nudged to be tried again once room is freed;
- :mod:`.verbs`: the handlers of the verbs kube-scheduler calls (and health, metrics);
- :mod:`.http`: the HTTP app of them, served over HTTP/1.1 and HTTP/2 (TLS from
  :mod:`gpuslice.services.tls`);
- :mod:`.loops`: following the API server's watch, the leader election and its label;
- :mod:`.metrics`: its Prometheus metrics.

The composition root is ``gpuslice extender`` (:mod:`gpuslice.cli.extender`).
"""

from gpuslice.services.extender.http import LEADER_LABEL, make_app, serve
from gpuslice.services.extender.state import ExtenderState, bind_clock
from gpuslice.services.tls import tls_context

__all__ = ["LEADER_LABEL", "ExtenderState", "bind_clock", "make_app", "serve", "tls_context"]
