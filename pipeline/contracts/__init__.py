"""What every process shares (config, run directory, trajectory rows, learner events, HTTP door,
durable writes, the staleness rule). Imports no torch and nothing else of rollwise."""
