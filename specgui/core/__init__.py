"""The decoding core: one loop for every method (`decode`, its step's parts `step`, `launch` and `clock`), drafts and
their verification, the KV cache, the runner, events and text."""
