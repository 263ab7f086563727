"""What a put or get becomes: the transfer paths (paths.py: the fast path, the fan-out, the
general path, stream-ordered transfers), the prepared transfers and their cache (plan.py,
plan_cache.py), batches (batch.py), lanes over several agents (lanes.py) and the retries after a
peer restarted (retries.py)."""
