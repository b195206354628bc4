"""The target's inference runtime: one forward for every stage that runs the target (eval's engine,
regenerate, precompute), fast where the architecture allows (runtime/model.py), transformers elsewhere."""
