"""Reward side of the dataflow: tasks (the prompt source, with ground truth, and the verifiers),
plugins.

Runs without Ray; actors/reward.py wraps it into a pool of workers.
"""
