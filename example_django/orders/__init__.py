"""Orders and their charges: the side effect a stale attempt must never apply twice."""
