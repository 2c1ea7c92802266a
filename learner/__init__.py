"""The learner process (`python -m learner.worker`, started by the daemon) and its maths."""
