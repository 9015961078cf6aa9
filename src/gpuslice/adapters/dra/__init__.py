"""Files of gpuslice's DRA driver on the node: CDI specs (``cdi``) and its checkpoint
(``checkpoint``)."""
