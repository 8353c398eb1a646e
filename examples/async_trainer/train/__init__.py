"""Training: the asynchronous stage loop, batches and the policy step, packing into
micro-batches, the behaviour policy's log-probs, the run's state, checkpoints and stopping."""
