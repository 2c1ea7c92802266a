"""Agent-process environments (process_agent.py): a command in the sandbox against its episode's endpoint;
agent_relay.py is the first program of each episode inside the sandbox."""

from envs.agent_process.process_agent import RELAY_PORT, AgentProcessEnvironment

__all__ = ["RELAY_PORT", "AgentProcessEnvironment"]
