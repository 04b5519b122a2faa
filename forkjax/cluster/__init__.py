"""Replicas of `python -m forkjax.serve` behind the Shepherd Model Gateway (SMG): `python -m
forkjax.cluster --replicas N --port P [flags of forkjax.serve]` (launcher.py starts and stops
them). Requests that send one `X-SMG-Routing-Key` (a workflow's id) all reach one replica, so a
workflow's agents share its cache there as on a single server."""
