"""Decides whether and when a request may be scheduled: tenants and their limits, usage accounting, time budgets,
holding for models with no ready engine, fallback models, priorities from the cluster, scale-from-zero requests,
and the fair queue for saturated models. Each step is a layer behind one interface (framework.py), registered by
name (registry.py, layers/) and composed in order (composition.py). Calls scheduling for the pick."""
