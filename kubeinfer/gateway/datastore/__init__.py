"""What the gateway knows about the engine pods, kept up to date off the request path: the endpoints and their
discovery (static or Kubernetes), load polling (the engines' /load report or Prometheus text) and the load table
the picker reads, the watched custom resources, and the KV-event state (which blocks each pod holds). The bottom
layer: it imports nothing else of the gateway."""
