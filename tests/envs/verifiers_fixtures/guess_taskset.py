"""A multi-turn verifiers taskset: its own Env plays the user, answering each reply with feedback until
the model names the secret or three turns pass; the reward is 1 for a hit, less for each miss."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: str


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        yield GuessTask(
            GuessData(name="secret-7", prompt="Guess my number (1-9).", secret="7"), self.config.task
        )


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        misses = 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated and segment.last_reply != task.data.secret and misses < 2:
                misses += 1
                segment = await interaction.turn(f"No, not {segment.last_reply}. Again.")
        hit = segment.last_reply == task.data.secret
        interaction.trace.record_reward("hit", 1.0 - 0.25 * misses if hit else 0.0)
        interaction.trace.record_metric("misses", float(misses))


__all__ = ["GuessEnv", "GuessTaskset"]
