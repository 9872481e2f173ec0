"""Environments used by the integration tests (loaded as `file.py:name`, as users would)."""

import itertools

from groupflow.rollout.toolbox import ToolCall
from groupflow.rollout.trajectory import Observation

# Printed by a program that could read this file from inside the sandbox: it must never show.
MARKER = "HOSTILE-MARKER-7f3a"
HOSTILE_PROGRAMS = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "read_outside": f"print(open({__file__!r}).read())",
    "write_outside": "open('/tmp/groupflow-escaped-sandbox', 'w').write('out')\nprint('written')",
    "memory": "x = bytearray(10**10)\nprint(len(x))",
    "hang": "while True:\n    pass",
    "benign": "print(6 * 7)",
}
_next_program = itertools.cycle(HOSTILE_PROGRAMS.values())


class EchoTwice:
    """Answers the first two turns with a tool message whatever the model wrote, so that
    every trajectory has three turns."""

    def __init__(self, prompt, tools):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return [{"role": "tool", "content": f"noted {self.turns}"}] if self.turns <= 2 else None


class HostilePython:
    """After the first turn, runs the next of HOSTILE_PROGRAMS with the python tool and
    shows the model the result; ends after the second turn."""

    def __init__(self, prompt, tools):
        self.tools = tools
        self.turns = 0

    async def step(self, turn):
        self.turns += 1
        if self.turns > 1:
            return None
        reply = await self.tools.call(ToolCall("python", {"code": next(_next_program)}))
        return Observation([{"role": "tool", "content": reply.content}], [reply.use])
