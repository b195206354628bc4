"""The serving engine our users run (vLLM), driven from its own environment: mtptrain/serving/vllm_engine.py."""
