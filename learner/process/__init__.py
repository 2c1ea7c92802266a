"""The learner process (`python -m learner.process`), one part per file:

shell.py         arguments, signals, stdin commands, its own run directory; builds the worker and runs it
group.py         the learner's ranks, or the one-process stand-in that does nothing for them
startup.py       the policy as the config builds it, restored from the latest checkpoint
intake.py        the spool read ahead, groups taken earliest deadline first and triaged
loop.py          LearnerWorker: the loop (take groups, train, publish, checkpoint), and the other ranks'
publisher.py     writing and announcing a version: inline, in the background or gathered over the ranks
checkpointer.py  one process's checkpoint or the ranks' sharded one
storage.py       writes retried while the storage refuses them

What they write: checkpoint.py (one process), sharded_checkpoint.py (several ranks; also the gathered
weights), checkpoint_state.py (what both record and how a checkpoint is found), background_export.py (the
weight snapshot and the thread of the background publisher).
"""
