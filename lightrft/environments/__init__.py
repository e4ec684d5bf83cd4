"""Multi-turn environments and tools (issue 24): the environment protocol, tools with generated
JSON schemas, the Hermes / Qwen tool-call format, and observation tokens rendered by the model's
chat template. See docs/environments.md."""

from lightrft.environments.base import Environment, EpisodeStats, ErrorKind, Step, aggregate_stats
from lightrft.environments.render import assistant_end_token, initial_prompt_ids, observation_ids
from lightrft.environments.tool_calls import (
    MalformedCall,
    ToolCall,
    parse_tool_calls,
    tool_call_format,
)
from lightrft.environments.tool_env import ToolEnvironment
from lightrft.environments.tools import (
    Tool,
    ToolResult,
    ToolTimeout,
    calculator,
    calculator_tool,
    python_tool,
)

__all__ = [
    "Environment",
    "EpisodeStats",
    "ErrorKind",
    "MalformedCall",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "ToolTimeout",
    "aggregate_stats",
    "assistant_end_token",
    "calculator",
    "calculator_tool",
    "initial_prompt_ids",
    "observation_ids",
    "parse_tool_calls",
    "python_tool",
    "tool_call_format",
]
