"""The Ray layer: thin actor wrappers around rollout/, learner/ and reward_workers/."""
