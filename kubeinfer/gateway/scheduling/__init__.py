"""Picks the endpoint for one request: filters, weighted scorers (queue, KV cache, LoRA placement, prefix), the
prefix indexes (approximate, from where requests were sent; precise, from the engines' KV events) and rendezvous
affinity. Reads the datastore; knows nothing of queues, tenants or HTTP."""
