"""The speculative inference engine: one loop (prefill, propose, verify, accept, advance) for every scheme."""
