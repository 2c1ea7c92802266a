"""The learner's loss: pure maths on tensors, no model and no optimizer (they stay in learner/).

`terms.Loss` is the sum of the terms a config turns on (policy surrogate, KL, entropy bonus, action prior,
MoE load balance), each with its own statistics. Nothing here imports the rest of the learner: a term reads
the batch and the forward through the protocols in `terms`.
"""
