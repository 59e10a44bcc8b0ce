"""Admission by count (router/admission.py): slots, the exact rejections, and the orchestrator
releasing a request's slot exactly once on every way it ends."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.admission import Admission, AdmissionControl, AdmissionRejection
from splitserve.router.api_types import GenerationInput, RouterError
from splitserve.router.policy import RoutingConfig
from splitserve.testing.in_process_cluster import InProcessCluster

FULL = AdmissionRejection("too_many_requests", "RESOURCE_EXHAUSTED", "the router has 2 requests in flight, its "
                          "limit (router.routing.max_in_flight_requests); retry later")
DRAINING = AdmissionRejection("draining", "UNAVAILABLE",
                              "the router is draining (shutting down): it takes no new requests")
PROMPT = tuple(range(5, 45))
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# ---- the pure core ----------------------------------------------------------------------------

def test_slots_up_to_the_limit_then_the_exact_rejection():
    idle = []
    control = AdmissionControl(2, on_idle=lambda: idle.append(control.in_flight))
    first, second = control.try_admit(), control.try_admit()
    assert isinstance(first, Admission) and isinstance(second, Admission)
    assert (control.try_admit(), control.in_flight) == (FULL, 2)
    first.release()
    third = control.try_admit()  # the freed slot
    assert isinstance(third, Admission) and control.in_flight == 2
    assert control.try_admit() == FULL
    second.release()
    third.release()
    assert (control.in_flight, idle) == (0, [0])



def test_watchers_see_the_free_slots_after_every_change_and_none_while_draining():
    """What the HTTP acceptor process refuses by: reported at once, after each admission and release (a refusal
    changes nothing), and None once a drain starts; nothing after the unwatch."""
    control = AdmissionControl(2)
    seen: list[int | None] = []
    unwatch = control.watch(seen.append)
    first, second = control.try_admit(), control.try_admit()
    assert control.try_admit() == FULL
    first.release()
    first.release()  # a second release frees nothing and says nothing
    control.stop_accepting()
    second.release()
    unwatch()
    assert isinstance(control.try_admit(), AdmissionRejection)
    assert seen == [2, 1, 0, 1, None, None]
    unlimited: list[int | None] = []
    AdmissionControl(None).watch(unlimited.append)
    assert unlimited == [None]


def test_the_capacity_rejection_is_what_a_full_router_answers():
    control = AdmissionControl(2)
    held = [control.try_admit(), control.try_admit()]
    assert control.capacity_rejection() == control.try_admit() == FULL and len(held) == 2


def test_a_slot_is_released_once_however_often_release_is_called():
    idle = []
    control = AdmissionControl(1, on_idle=lambda: idle.append(True))
    slot = control.try_admit()
    slot.release()
    slot.release()
    assert (slot.released, control.in_flight, idle) == (True, 0, [True])
    other = control.try_admit()
    slot.release()  # a stale release must not free the slot someone else holds now
    assert control.in_flight == 1 and isinstance(other, Admission)
    assert control.try_admit() == AdmissionRejection(
        "too_many_requests", "RESOURCE_EXHAUSTED",
        "the router has 1 requests in flight, its limit (router.routing.max_in_flight_requests); retry later")


def test_draining_refuses_even_with_free_slots_and_admitted_ones_still_release():
    control = AdmissionControl(2)
    held = control.try_admit()
    control.stop_accepting()
    assert (control.try_admit(), control.accepting) == (DRAINING, False)
    held.release()
    assert control.in_flight == 0


def test_no_limit_admits_every_request():
    control = AdmissionControl(None)
    slots = [control.try_admit() for _ in range(10_000)]
    assert all(isinstance(slot, Admission) for slot in slots) and control.in_flight == 10_000


def test_an_invalid_limit_is_refused():
    with pytest.raises(ValueError, match="max_in_flight must be >= 1, got 0"):
        AdmissionControl(0)


# ---- the orchestrator releases a slot on every path --------------------------------------------

def test_the_orchestrator_releases_the_slot_on_every_way_a_request_ends(tiny_llama_dir):
    """Success, a prompt refused in generate(), a cancelled task, a consumer that closes the stream
    after its first chunk, and a stream its caller never started (the caller releases): the slot
    is free after each, once; a full router refuses at the door and counts it."""
    routing = RoutingConfig(disaggregation="always", max_in_flight_requests=1)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=routing) as cluster:
            orchestrator = cluster.orchestrator
            in_flight = []

            async def run(request_id: str, params: SamplingParams, prompt=PROMPT):
                return [chunk async for chunk in orchestrator.generate(GenerationInput(request_id, prompt, params),
                                                                       orchestrator.admit())]

            finished = await run("ok", SHORT)
            in_flight.append(orchestrator.admission.in_flight)
            with pytest.raises(InvalidRequestError):
                await run("empty", SHORT, prompt=())
            in_flight.append(orchestrator.admission.in_flight)
            stream = orchestrator.generate(GenerationInput("cancelled", PROMPT, LONG), orchestrator.admit())
            task = asyncio.ensure_future(anext(stream))
            await task  # running now
            with pytest.raises(RouterError) as full:
                orchestrator.admit()
            task = asyncio.ensure_future(_drain(stream))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            in_flight.append(orchestrator.admission.in_flight)
            closed = orchestrator.generate(GenerationInput("closed", PROMPT, LONG), orchestrator.admit())
            await anext(closed)
            await closed.aclose()
            in_flight.append(orchestrator.admission.in_flight)
            slot = orchestrator.admit()
            never_started = orchestrator.generate(GenerationInput("never", PROMPT, LONG), slot)
            await never_started.aclose()  # the body never ran: the caller's release frees the slot
            in_flight.append(orchestrator.admission.in_flight)
            slot.release()
            in_flight.append(orchestrator.admission.in_flight)
            await cluster.wait_idle()
            return finished, in_flight, full.value, orchestrator.routing_stats().rejections

    finished, in_flight, full, rejections = asyncio.run(scenario())
    assert finished[-1].finish_reason == "length"
    assert in_flight == [0, 0, 0, 0, 1, 0]
    assert (full.code, full.message) == ("RESOURCE_EXHAUSTED", "the router has 1 requests in flight, its limit "
                                         "(router.routing.max_in_flight_requests); retry later")
    assert rejections == (("too_many_requests", 1),)


async def _drain(stream) -> None:
    async for _ in stream:
        pass
