"""The gRPC API: the `Engine` service (server) over the same engine as the HTTP API, its proto and
generated stubs (proto/), and the standard gRPC health service."""
