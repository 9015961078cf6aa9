"""The kubelet's device plugin API (gRPC over unix sockets): generated messages and stubs."""
