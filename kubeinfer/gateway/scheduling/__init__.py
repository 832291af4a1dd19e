"""Picks the endpoint for one request: the scheduling framework (filters, scorers, pickers and profile handlers
as plugins registered by name, composed into profiles by the flags or an EndpointPickerConfig), the shipped
plugins (`plugins/`: admission and load filters; queue, KV cache, LoRA, prefix and affinity scorers; max-score
and round-robin), and the prefix indexes (approximate, from where requests were sent; precise, from the
engines' KV events). Reads the datastore; knows nothing of queues, tenants or HTTP."""
