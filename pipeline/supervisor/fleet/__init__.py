"""The processes the daemon keeps and the engines it serves through: child processes (children.py),
the engine fleet (engine_fleet.py: managed engines, the router, liveness, weight fetches) and how an
engine is launched (engine_launch.py), engines joining and leaving at run time (fleet_membership.py,
admin.py), the doors other hosts come through (fleet_services.py), the dedicated evaluation engine
(eval_engine.py) and the core split between engines and learner (core_split.py). Imports nothing from
the supervisor package that composes it."""
