"""A single-turn verifiers taskset (docs/environments.md, "verifiers"), loaded as
`task.name: verifiers:tests.integration.plugins.sums_taskset`: the sums of two one-digit
numbers, written as the quickstart model's arithmetic prompts are, scored by its own reward."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class SumsConfig(vf.TasksetConfig):
    count: int = 100


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for i in range(self.config.count):
            a, b = divmod(i % 100, 10)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SumsTaskset"]
