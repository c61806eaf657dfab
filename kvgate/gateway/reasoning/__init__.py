"""Reasoning output: a model's thinking split from its reply, below both doors."""
