"""The daemon process (`rollwise run`): daemon.py is its schedule; actors/ produce trajectories,
engines/ talk to inference engines, observability/ exports what happens."""
