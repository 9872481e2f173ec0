"""groupflow: RL training of language models from verifiable rewards on Ray, vLLM and DeepSpeed.

This package also holds the repository's top-level folders as subpackages: pyproject.toml's
package-dir maps actors/, rollout/, learner/ and reward_workers/ to groupflow.actors,
groupflow.rollout, groupflow.learner and groupflow.reward_workers (so groupflow.learner.credit
is learner/credit.py on disk). Nothing is imported here: `import groupflow` stays cheap.
"""
