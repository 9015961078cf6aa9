"""The reconfiguration controller: change how GPUs are sliced while services keep answering.

It follows ``SliceSchedule`` objects (group ``gpuslice.io``, see ``deploy/base/crd-slice-
schedule.yaml``) and moves every GPU they select to the layout wanted now, one GPU at a time:

1. **Waiting**: the replicas on the GPU must fit on the other open GPUs (:func:`room_for`);
   when they do not, nothing is touched and the status says why.
2. **Cordoned**: the GPU's UUID joins the node's ``gpuslice.io/cordoned-gpus``; the extender
   places no new slice on it. The schedule gets the finalizer ``gpuslice.io/reconfig`` first.
3. **Moving**: a replacement pod per replica on the GPU (same spec, new name, recorded in the
   status before it is created); the scheduler and extender place them elsewhere. Waits until
   every replacement runs and is ready, at most ``spec.readyTimeoutSeconds``; past it the
   replacements made drain and leave (**Retiring**) and the GPU reopens unchanged (Failed).
4. **Draining**: the old pods get ``gpuslice.io/draining`` (annotation and label); every router
   replica (found through its Service's EndpointSlices) stops sending them requests and lets
   in-flight ones finish; once every one reports none in flight (or the drain timeout
   passes) the old pods are evicted. A ReplicaSet's pod is moved through a stand-in without
   the ReplicaSet's ``pod-template-hash`` (so it is neither adopted nor counted);
   **Restoring** waits until the ReplicaSet has replaced the evicted pods and they are ready,
   then the stand-ins drain and leave; if that takes longer than ``spec.readyTimeoutSeconds``
   the stand-ins are handed to their ReplicaSets (the hash back: the ReplicaSet adopts them
   and removes its surplus), so none is left without an owner. Pods of other owners (a
   StatefulSet's: their name is their identity) are not moved; the GPU waits and says why.
5. **Applying**: the GPU's layout goes into the node's ``gpuslice.io/mig-desired``; the node
   agent applies it once the GPU has no client and reports it in ``gpuslice.io/mig-layouts``.
   A failure there leads to **RollingBack** (the last good layout asked for again) and then
   **Failed** with the reason; success to reopening the GPU (cordon removed) and **Done**.

Every step is written to the object's status before it is acted on, and every action is
idempotent, so a controller killed at any point and started again resumes where the status
says (the replacements it had named are found, not created twice; no pod is deleted before its
replacement is ready). Shared annotations are written at the object's resourceVersion, and
with ``--leader-elect`` only the holder of a Lease acts. A schedule deleted mid-move is held
by its finalizer until the move is finished or undone (**Cancelled**: cordon lifted, the pods
it made gone, a layout not yet applied withdrawn).
"""

from gpuslice.services.reconfig.controller import ACTIVE, FINALIZER, PLURAL, ReconfigController
from gpuslice.services.reconfig.leading import LeadingController
from gpuslice.services.reconfig.pods import label_key

_label_key = label_key  # the name tests and older callers use

__all__ = ["ACTIVE", "FINALIZER", "PLURAL", "LeadingController", "ReconfigController",
           "_label_key", "label_key"]
