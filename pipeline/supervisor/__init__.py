"""The daemon process (`rollwise run`): daemon.py is its schedule; actors/ produce trajectories,
engines/ talk to inference engines, fleet/ keeps the child processes and the engine fleet,
observability/ exports what happens."""
