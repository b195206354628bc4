"""Benchmark prompt sets and evaluation entry points."""
