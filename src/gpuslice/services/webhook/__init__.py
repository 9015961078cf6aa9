"""The mutating admission webhook (``gpuslice webhook``, its own Deployment): pods of the
namespaces and pods that opt in get gpuslice's scheduler, their GPU memory made explicit and
their plain GPU requests translated, and what no GPU could take is refused at admission
(the policy: :mod:`gpuslice.core.admission`; the user's account: docs/webhook.md).

- :mod:`.review`: the AdmissionReview wire format and the JSON patch;
- :mod:`.fleet`: the GPUs of the cluster, read from the nodes' inventories;
- :mod:`.http`: the HTTPS app kube-apiserver calls, health, readiness and metrics.

The composition root is ``gpuslice webhook`` (:mod:`gpuslice.cli.webhook`).
"""

from gpuslice.services.webhook.fleet import FleetView, fleet_from_nodes
from gpuslice.services.webhook.http import make_app, serve
from gpuslice.services.webhook.review import review_of

__all__ = ["FleetView", "fleet_from_nodes", "make_app", "review_of", "serve"]
