"""Communication: the collective group of a generation (configure, abort, destroy), the bucketed gradient reducer, the commit vote."""
