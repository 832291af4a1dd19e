"""The gateway's request paths: the Envoy ext_proc server, the standalone HTTP proxy and its forwarding to engines
(upstream clients, retries, relay), the shared routing decision that runs flow control then the picker, and the
gateway's own Prometheus metrics. The top layer below app.py and cli.py."""
