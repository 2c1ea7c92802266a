"""`rollwise inspect`: a local web page over a run's trajectories, token by token."""
