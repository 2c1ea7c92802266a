"""A single-turn verifiers taskset from in-memory data: the answer is the reply, scored exactly. Its last
task's scoring is broken (the reward raises), as a taskset's can be: that episode must fail, not score.
A metric probes the network the scoring code has: whether the TCP port in $PROBE_PORT answers."""

import os
import socket

import verifiers.v1 as vf

PROBLEMS = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"), ("What is 7 - 6?", "1"), ("What is 1 / 0?", "")]


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        if not self.data.answer:
            raise ValueError("this task stores no answer to compare with")
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))

    @vf.metric
    async def probe_port_reachable(self) -> float:
        port = os.environ.get("PROBE_PORT")
        if not port:
            return -1.0
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
        except OSError:
            return 0.0
        return 1.0


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for index, (question, answer) in enumerate(PROBLEMS):
            yield ArithTask(
                ArithData(name=f"arith-{index}", prompt=question, answer=answer), self.config.task
            )


__all__ = ["ArithTaskset"]
