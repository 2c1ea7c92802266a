"""The learner process (`python -m learner.process`, started by the daemon) and its maths."""
