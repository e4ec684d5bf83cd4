"""Multi-turn environments and tools (issue 24): the environment protocol, tools with generated
JSON schemas, the Hermes / Qwen tool-call format, and observation tokens rendered by the model's
chat template, and SFT on tool-use transcripts rendered the same way. See docs/environments.md."""

from lightrft.environments.base import Environment, EpisodeStats, ErrorKind, Step, aggregate_stats
from lightrft.environments.episode import (
    Episode,
    Episodes,
    TurnRecord,
    build_environment,
    check_environment,
    episode_metrics,
    stop_at_turn_end,
)
from lightrft.environments.render import (
    assistant_end_token,
    assistant_turn_text,
    initial_prompt_ids,
    observation_ids,
    transcript_ids,
)
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
    calculator,
    calculator_tool,
    python_tool,
    shipped_tool,
)
from lightrft.environments.transcripts import ToolSFTDataset

__all__ = [
    "Environment",
    "Episode",
    "EpisodeStats",
    "Episodes",
    "ErrorKind",
    "MalformedCall",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "ToolSFTDataset",
    "TurnRecord",
    "aggregate_stats",
    "assistant_end_token",
    "assistant_turn_text",
    "build_environment",
    "calculator",
    "calculator_tool",
    "check_environment",
    "episode_metrics",
    "initial_prompt_ids",
    "observation_ids",
    "parse_tool_calls",
    "python_tool",
    "shipped_tool",
    "stop_at_turn_end",
    "tool_call_format",
    "transcript_ids",
]
