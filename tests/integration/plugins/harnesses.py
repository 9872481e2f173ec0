"""Harnesses used by the integration tests (loaded as `file.py:name`, as users would): agent
code written against the OpenAI API, calling a job's endpoint with the real openai SDK."""

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "exact arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


async def _three_calls(row, endpoint, rewrite):
    """Three calls: a reply's tool call answered by a tool message (a reply without one by a
    user message), the reply sent back as the SDK returned it, or as `rewrite` makes it."""
    messages = [{"role": "user", "content": row.text}]
    reply = None
    for _ in range(3):
        answer = await endpoint.client.chat.completions.create(
            model=endpoint.model, messages=messages, tools=[CALCULATOR], max_tokens=16
        )
        reply = answer.choices[0].message
        messages.append(rewrite(reply.model_dump(exclude_none=True)))
        if reply.tool_calls:
            call = reply.tool_calls[0]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "84"})
        else:
            messages.append({"role": "user", "content": "again"})
    return reply.content or ""


async def three_tool_calls(row, endpoint):
    return await _three_calls(row, endpoint, lambda message: message)


async def rewrites_earlier_turns(row, endpoint):
    """Sends each reply back with its text dropped, as a harness that drops earlier turns'
    reasoning does: the history the engine saw is rewritten at every call."""
    return await _three_calls(row, endpoint, lambda message: {**message, "content": "ok"})
