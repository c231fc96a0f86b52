"""Methods that draft from n-grams: prompt lookup, Self-Draft, Lookahead, and the n-gram caches they share."""
