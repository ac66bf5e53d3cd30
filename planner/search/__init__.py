"""Choosing a placement and a schedule: the layer-group search, the copy/compute simulation, the prefetch schedule,
serving concurrency, routed experts against whole layers, and adapter slots."""
