"""A verifiers taskset whose reward is drawn at random, whatever the model writes: every group of a daemon
that trains through it with a random tiny model has variance (a uniform draw never ties)."""

import random

import verifiers.v1 as vf


class CoinTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def draw(self, trace: vf.Trace) -> float:
        return random.random()


class CoinTaskset(vf.Taskset[CoinTask, vf.TasksetConfig]):
    def load(self):
        for index in range(4):
            yield CoinTask(
                vf.TaskData(name=f"coin-{index}", prompt=f"Say something about {index}."), self.config.task
            )


__all__ = ["CoinTaskset"]
