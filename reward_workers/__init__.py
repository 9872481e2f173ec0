"""Reward side of the dataflow: tasks (prompt sources with ground truth), verifiers, plugins.

Runs without Ray; actors/reward.py wraps it into a pool of workers.
"""
