"""Layers waiting for their CUDA events (connector.engine.layer_events): the layers one loop turn holds cost one wait,
on the last event, and are then ready in the order they came."""

import asyncio
import threading

from connector.engine.layer_events import LayerEvents


class Event:
    """Stands in for a torch.cuda.Event: `synchronize` notes who was waited for, on which thread."""

    def __init__(self, name: str, waited: list) -> None:
        self.name, self.waited = name, waited

    def synchronize(self) -> None:
        self.waited.append((self.name, threading.get_ident()))


def test_one_wait_per_turn_on_the_last_event_then_every_layer_in_order():
    async def main() -> tuple[list, list, LayerEvents, int]:
        loop = asyncio.get_running_loop()
        waited: list = []
        ready: list = []
        tasks: list = []
        events = LayerEvents(loop, lambda coro: tasks.append(loop.create_task(coro)), ready.append)
        for layer in range(3):  # one drain's layers: the same turn
            events.add(("req", layer, 256), Event(f"e{layer}", waited))
        assert ready == [] and events.waits == 0  # nothing waited for inside the turn itself
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert ready == [("req", 0, 256), ("req", 1, 256), ("req", 2, 256)]  # all three, once the last was waited for
        events.add(("req", None, 256), Event("sweep", waited))  # the next turn: a wait of its own
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return waited, ready, events, threading.get_ident()

    waited, ready, events, loop_thread = asyncio.run(main())
    assert [name for name, _ in waited] == ["e2", "sweep"]  # the last of each turn only
    assert all(thread != loop_thread for _, thread in waited)  # never on the loop's own thread
    assert ready == [("req", 0, 256), ("req", 1, 256), ("req", 2, 256), ("req", None, 256)]
    assert events.waits == 2


def test_a_failed_wait_marks_nothing_and_reaches_the_owner():
    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access")

    async def main() -> tuple[list, BaseException | None]:
        loop = asyncio.get_running_loop()
        ready: list = []
        tasks: list = []
        events = LayerEvents(loop, lambda coro: tasks.append(loop.create_task(coro)), ready.append)
        events.add("layer 0", Broken())
        await asyncio.sleep(0)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return ready, done[0]

    ready, failure = asyncio.run(main())
    assert ready == [] and isinstance(failure, RuntimeError)
