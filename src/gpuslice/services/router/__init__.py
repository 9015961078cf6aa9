"""The router service (``gpuslice router``): wires the pure routing core (``core/routing.py``,
``core/routing_llm.py``) to the HTTP proxy. :mod:`.state` holds the replicas and the policy's
state and decides each request; :mod:`.llm` is what generative (OpenAI-style) services add;
:mod:`.sources` reads the configuration (a file, a plan, EndpointSlices); :mod:`.app` runs the
process around them."""

from gpuslice.services.router.app import RouterApp, run, serve, start_router
from gpuslice.services.router.sources import ConfigLoader, ServeOptions, make_loader
from gpuslice.services.router.state import Router

__all__ = ["ConfigLoader", "Router", "RouterApp", "ServeOptions", "make_loader", "run", "serve",
           "start_router"]
