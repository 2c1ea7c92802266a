"""`rollwise bench ...`: each benchmark prints its figure as a ratio against a baseline run in the same
process."""
