"""Agent loops: trajectories written turn by turn through the server manager.

``AgentLoop`` is the seam a user subclasses (one ``async def run``); ``SingleTurnAgentLoop`` and
``ToolAgentLoop`` are built in and registered as ``"single_turn"`` and ``"tool"``;
``run_agent_loops`` rolls a batch out with bounded concurrency. Each module states its invariants.
"""

from asyncroll.agent_loop.base import AgentLoop, ServerManager
from asyncroll.agent_loop.loops import SingleTurnAgentLoop, ToolAgentLoop
from asyncroll.agent_loop.output import (
    AgentLoopMetrics,
    AgentLoopOutput,
    ResponseBuilder,
    Sample,
    StopReason,
)
from asyncroll.agent_loop.parsers import HermesToolCallParser, TextTokenizer, TokenToolCallParser
from asyncroll.agent_loop.registry import (
    agent_loop_class,
    register_agent_loop,
    registered_agent_loops,
)
from asyncroll.agent_loop.runner import AgentLoopFailure, run_agent_loops
from asyncroll.agent_loop.tools import (
    MalformedToolCall,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolResult,
    call_tool,
    call_tools,
)

__all__ = [
    "AgentLoop",
    "AgentLoopFailure",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "HermesToolCallParser",
    "MalformedToolCall",
    "ResponseBuilder",
    "Sample",
    "ServerManager",
    "SingleTurnAgentLoop",
    "StopReason",
    "TextTokenizer",
    "TokenToolCallParser",
    "Tool",
    "ToolAgentLoop",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "agent_loop_class",
    "call_tool",
    "call_tools",
    "register_agent_loop",
    "registered_agent_loops",
    "run_agent_loops",
]
