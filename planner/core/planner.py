"""The planner's decision core: each tick an Observation in, a Decision out, with explicit state between.

One decision (`plan`):
1. Refit the performance model on the window's step samples (perf_model).
2. Feedback: compare the observed TTFT / ITL p99 with what the model predicts for the routable replicas at
   the window's own load, and move a bounded latency correction (a multiplier on predicted latencies) part
   of the way toward their ratio.
3. The load to plan for: the arrival rate expected when capacity asked for at the next chance could serve
   (scale_up_cooldown_s + scale_up_s ahead; a least-squares line through the last `trend_ticks` windows'
   rates, flat unless its slope is significant, never below the current rate, at most `max_trend_factor`
   times it) plus `rate_confidence_z`
   standard errors of one window's estimate, plus each pool's queued requests drained within one tick.
4. Search (queueing): the fewest devices (prefill + decode) predicted to meet the attainment target, and
   the fewest meeting target + scale_down_margin (the scale-down side of the hysteresis band). When the
   target is out of reach within max_replicas, each pool takes the goodput-maximising count instead.
   The prefill pool's prefix hit rate shrinks with it below the observed count
   (queueing.PrefixScaledPrefillPool): fewer workers cache fewer tenants' prefixes.
5. Policy per pool: starting replicas count as provisioned; scale up past a cooldown since the pool's last
   change, at most max_step at a time; scale down only after the margin held `scale_down_ticks`
   consecutive ticks and past the (longer) scale-down cooldown; min/max bounds are hard.
6. Local-prefill threshold: the largest uncached prompt whose prefill, riding in a decode worker's step,
   keeps that step within the ITL target at the chosen decode pool's p99 batch.

Every reason starts with one of REASONS, then a colon, then the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from splitserve.common.validation import require
from splitserve.planner.core.perf_model import FitConfig, PerformanceModel
from splitserve.planner.core.queueing import (DecodePool, DecodeWorkload, PrefillPool, PrefillWorkload,
                                              PrefixScaledPrefillPool)
from splitserve.planner.core.types import (Decision, LengthHistogram, Observation, PlannerConfig, PoolBounds,
                                           PoolTarget, Prediction, Role)

REASONS = ("scale_up", "scale_down", "hold", "cooldown", "at_max", "at_min", "bounded_step")


@dataclass(frozen=True)
class PlannerTuning:
    """The planner's internal knobs (not part of the cluster config); the defaults suit ticks of ~10 s."""

    fit: FitConfig = field(default_factory=FitConfig)
    trend_ticks: int = 6
    """Windows (newest last) the arrival-rate trend is fitted over; 1: no trend."""
    max_trend_factor: float = 2.0
    """The planned arrival rate is at most this multiple of the current one."""
    trend_significance_z: float = 2.0
    """The trend's slope counts only this many standard errors from 0 (planning_rate); 0: always."""
    rate_confidence_z: float = 2.0
    """Standard errors of the window's arrival count added to the planned rate (0: plan for the estimate)."""
    correction_gain: float = 0.3
    """Per tick, the latency correction moves this fraction of the way (in log space) to observed/predicted."""
    max_correction: float = 2.0
    """The latency correction stays in [1 / max_correction, max_correction]."""
    best_effort_tolerance: float = 1e-3
    """Target out of reach: each pool takes the fewest replicas whose attainment is within this relative
    distance of its attainment at max_replicas (max_replicas when even that is overloaded)."""
    default_prompt_tokens: int = 512
    """Prompt length assumed until a window has seen one."""
    default_output_tokens: int = 128
    """Output length assumed until a window has seen a request finish."""

    def __post_init__(self) -> None:
        require(self.trend_ticks >= 1, f"trend_ticks must be >= 1, got {self.trend_ticks}")
        require(self.max_trend_factor >= 1, f"max_trend_factor must be >= 1, got {self.max_trend_factor}")
        require(self.rate_confidence_z >= 0 and self.trend_significance_z >= 0,
                "rate_confidence_z and trend_significance_z must be >= 0")
        require(0 <= self.correction_gain <= 1, f"correction_gain must be in [0, 1], got {self.correction_gain}")
        require(self.max_correction >= 1, f"max_correction must be >= 1, got {self.max_correction}")
        require(0 <= self.best_effort_tolerance < 1, "best_effort_tolerance must be in [0, 1)")
        require(self.default_prompt_tokens >= 1 and self.default_output_tokens >= 1,
                "default_prompt_tokens and default_output_tokens must be >= 1")


@dataclass(frozen=True)
class PoolMemory:
    """What the planner remembers about one pool between ticks."""

    last_change_s: float | None = None
    """When this planner last changed the pool's target (None: never)."""
    scale_down_ticks: int = 0
    """Consecutive ticks, up to the last one, at which a scale-down was predicted safe (0 after a change)."""


@dataclass(frozen=True)
class LatencyCorrection:
    """Smoothed, bounded observed/predicted p99 latency ratios; predicted latencies are multiplied by them."""

    ttft: float = 1.0
    itl: float = 1.0


@dataclass(frozen=True)
class PlannerState:
    """Everything the planner carries from one tick to the next."""

    model: PerformanceModel
    prefill: PoolMemory = PoolMemory()
    decode: PoolMemory = PoolMemory()
    correction: LatencyCorrection = LatencyCorrection()
    arrival_history: tuple[tuple[float, float], ...] = ()
    """(window midpoint s, requests/s) of the last trend_ticks windows, oldest first."""
    prompt_lengths: LengthHistogram = LengthHistogram()
    """The prompt lengths last planned with: the last window's that saw any (else the default)."""
    output_lengths: LengthHistogram = LengthHistogram()
    """Same for output lengths."""
    last_now_s: float | None = None
    """The previous observation's now_s (None: no tick yet); observations come in time order."""


@dataclass(frozen=True)
class Traffic:
    """The load one prediction is made for."""

    arrival_rate: float
    prompt_lengths: LengthHistogram
    output_lengths: LengthHistogram
    prefill_backlog_rps: float = 0.0
    """Extra requests/s to drain the prefill queue within a tick."""
    decode_backlog_rps: float = 0.0


@dataclass(frozen=True)
class Allocation:
    prefill: int
    decode: int


@dataclass(frozen=True)
class PoolOutcome:
    """One pool's decision and the memory it leaves for the next tick."""

    target: PoolTarget
    memory: PoolMemory


class Planner:
    """`Planner(config).decide(observation)`: the one entry point of the Ray adapter and the simulator.

    Holds only a PlannerState (replaced, never mutated, each tick); `plan` is the pure function behind it."""

    def __init__(self, config: PlannerConfig, tuning: PlannerTuning | None = None) -> None:
        self.config = config
        self.tuning = tuning or PlannerTuning()
        self._state = PlannerState(PerformanceModel.from_profile(config.profile, self.tuning.fit))

    @property
    def state(self) -> PlannerState:
        return self._state

    def decide(self, observation: Observation) -> Decision:
        self._state, decision = plan(self.config, self.tuning, self._state, observation)
        return decision


def plan(config: PlannerConfig, tuning: PlannerTuning, state: PlannerState,
         observation: Observation) -> tuple[PlannerState, Decision]:
    """One tick: the next state and the decision (module docstring, steps 1-6)."""
    # An earlier now_s would read cooldowns as negative ("changed -50 s ago") and reverse the trend.
    require(state.last_now_s is None or observation.now_s >= state.last_now_s,
            f"now_s {observation.now_s} is before the previous observation's {state.last_now_s} "
            "(observations must come in time order)")
    model = state.model.update(observation.prefill_steps, observation.decode_steps)
    observed = Traffic(observation.arrival_rate,
                       _remembered(observation.prompt_lengths, state.prompt_lengths, tuning.default_prompt_tokens),
                       _remembered(observation.output_lengths, state.output_lengths, tuning.default_output_tokens))
    correction = _corrected(state.correction, observation,
                            _pools(config, observation, model, observed, LatencyCorrection()), tuning)
    history = (*state.arrival_history, (observation.now_s - observation.window_s / 2, observation.arrival_rate))
    history = history[-tuning.trend_ticks:]
    planned = _planned(observed, config, tuning, history, observation)
    prefill_pool, decode_pool = _pools(config, observation, model, planned, correction)
    prefill, decode = _targets(config, tuning, state, observation, prefill_pool, decode_pool)
    threshold = local_prefill_threshold(model, decode_pool, decode.target.replicas, config.itl_s, correction.itl)
    predicted = _prediction(prefill_pool, decode_pool, Allocation(prefill.target.replicas, decode.target.replicas),
                            planned.arrival_rate)
    next_state = PlannerState(model, prefill.memory, decode.memory, correction, history, observed.prompt_lengths,
                              observed.output_lengths, observation.now_s)
    return next_state, Decision(observation.now_s, prefill.target, decode.target, threshold, predicted)


def _planned(observed: Traffic, config: PlannerConfig, tuning: PlannerTuning,
             history: tuple[tuple[float, float], ...], observation: Observation) -> Traffic:
    """The load to size for: the trend's rate when capacity asked for after this decision could next arrive
    (scale_up_cooldown_s + scale_up_s ahead; a tick stands in for scale_up_s until it is measured) plus its
    sampling error, and each pool's queue drained within a tick. What this tick starts must carry the load
    until then: the pool cannot change again before the cooldown ends, and what it asks for then takes
    scale_up_s to serve."""
    scale_up_s = observation.scale_up_s if observation.scale_up_s is not None else config.tick_s
    horizon_s = config.scale_up_cooldown_s + scale_up_s
    window_error = rate_standard_error(observation.arrival_rate, observation.arrival_cv2, observation.window_s)
    rate = planning_rate(history, observation.now_s + horizon_s, tuning.max_trend_factor, window_error ** 2,
                         tuning.trend_significance_z)
    rate += tuning.rate_confidence_z * rate_standard_error(rate, observation.arrival_cv2, observation.window_s)
    return replace(observed, arrival_rate=rate, prefill_backlog_rps=observation.prefill.queue_depth / config.tick_s,
                   decode_backlog_rps=observation.decode.queue_depth / config.tick_s)


def rate_standard_error(rate: float, arrival_cv2: float, window_s: float) -> float:
    """Standard error of a rate estimated from one window's arrivals: the count of a renewal process over
    a long window has variance ~ cv^2 * rate * window (Poisson: cv^2 = 1); a burstier than Poisson window
    is noisier, a smoother one is taken as Poisson (no credit for regularity one window suggests).

    Why it matters: a window that happens to run 10% light (one standard error at 10 req/s over 10 s)
    otherwise reads as room to scale down, and the queue that builds takes minutes to drain."""
    return math.sqrt(max(arrival_cv2, 1.0) * rate / window_s)


def _remembered(seen: LengthHistogram, last: LengthHistogram, default_tokens: int) -> LengthHistogram:
    """This window's lengths, else the last ones seen, else the default: a window without a finished
    request must not read as 'requests need no decoding'."""
    if seen.total:
        return seen
    return last if last.total else LengthHistogram.of([default_tokens])


def _pools(config: PlannerConfig, observation: Observation, model: PerformanceModel, traffic: Traffic,
           correction: LatencyCorrection) -> tuple[PrefixScaledPrefillPool, DecodePool]:
    def prefill_at(hit_rate: float) -> PrefillPool:
        workload = PrefillWorkload.build(traffic.arrival_rate + traffic.prefill_backlog_rps, observation.arrival_cv2,
                                         traffic.prompt_lengths, hit_rate, model)
        return PrefillPool(workload, config.ttft_s, correction.ttft)

    prefill = PrefixScaledPrefillPool(prefill_at, observation.prefix_hit_rate, observation.prefill.replicas)
    decode = DecodeWorkload.build(traffic.arrival_rate + traffic.decode_backlog_rps, traffic.output_lengths,
                                  traffic.prompt_lengths, observation.transfer_s_p50,
                                  observation.decode.kv_capacity_tokens, model)
    return prefill, DecodePool(decode, config.itl_s, correction.itl)


def _corrected(previous: LatencyCorrection, observation: Observation,
               observed_pools: tuple[PrefixScaledPrefillPool, DecodePool],
               tuning: PlannerTuning) -> LatencyCorrection:
    """Nudge each correction toward observed p99 / predicted p99 for the replicas that served the window."""
    prefill_pool, decode_pool = observed_pools
    ttft = _nudged(previous.ttft, observation.ttft_p99_s,
                   prefill_pool.ttft_quantile_s(observation.prefill.replicas), tuning)
    itl = _nudged(previous.itl, observation.itl_p99_s, decode_pool.itl_quantile_s(observation.decode.replicas), tuning)
    return LatencyCorrection(ttft, itl)


def _nudged(previous: float, observed: float | None, predicted: float, tuning: PlannerTuning) -> float:
    """previous^(1 - gain) * (observed / predicted)^gain, clamped to the bounds; unchanged without a usable pair
    (nothing observed, or a prediction of 0 or infinity)."""
    if observed is None or observed <= 0 or not 0 < predicted < math.inf:
        return previous
    gain = tuning.correction_gain
    log_value = gain * math.log(observed / predicted) + (1 - gain) * math.log(previous)
    bound = math.log(tuning.max_correction)
    return math.exp(min(max(log_value, -bound), bound))


def planning_rate(history: tuple[tuple[float, float], ...], at_s: float, max_factor: float,
                  window_rate_variance: float = 0.0, significance_z: float = 0.0) -> float:
    """The arrival rate to size for at time at_s: the least-squares line through history ((time, rate),
    newest last, non-empty) evaluated there, clamped to [current rate, max_factor * current rate].

    The slope counts only when it is at least significance_z standard errors from 0, each window's rate
    having variance window_rate_variance; otherwise the line is flat at the windows' mean. Why: projected
    tens of seconds ahead, the slope of a few noisy windows of a steady load says "rising" half the time,
    and each such tick over-provisions."""
    current = history[-1][1]
    mean_time = sum(t for t, _ in history) / len(history)
    mean_rate = sum(r for _, r in history) / len(history)
    spread = sum((t - mean_time) ** 2 for t, _ in history)
    if spread == 0:
        return current
    slope = sum((t - mean_time) * (r - mean_rate) for t, r in history) / spread
    if abs(slope) < significance_z * math.sqrt(window_rate_variance / spread):
        slope = 0.0
    projected = mean_rate + slope * (at_s - mean_time)
    return max(current, min(projected, max_factor * current))


def _first_meeting(meets: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest n in [low, high] with meets(n), for a monotone `meets` that holds at high."""
    while low < high:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle + 1
    return low


def fewest_devices(prefill: Callable[[int], float], decode: Callable[[int], float],
                   bounds: tuple[PoolBounds, PoolBounds], target: float, current: Allocation) -> Allocation | None:
    """The allocation within bounds with the fewest prefill + decode replicas whose predicted attainment
    prefill(p) * decode(d) >= target (both non-decreasing); None when even max/max misses it.

    Walks the frontier: for each p from the least that can work, the least d that works (binary search,
    never above the previous p's); stops once p + the least d any p allows cannot beat the best. Ties go
    to the allocation nearest `current`, so an even trade between pools does not flap."""
    prefill_bounds, decode_bounds = bounds
    prefill_ceiling, decode_ceiling = prefill(prefill_bounds.max_replicas), decode(decode_bounds.max_replicas)
    if prefill_ceiling * decode_ceiling < target:
        return None
    p_low = _first_meeting(lambda p: prefill(p) * decode_ceiling >= target, prefill_bounds.min_replicas,
                           prefill_bounds.max_replicas)
    d_low = _first_meeting(lambda d: prefill_ceiling * decode(d) >= target, decode_bounds.min_replicas,
                           decode_bounds.max_replicas)
    best: tuple[int, int, int, int] | None = None  # (devices, distance to current, p, d)
    d_high = decode_bounds.max_replicas
    for p in range(p_low, prefill_bounds.max_replicas + 1):
        if best is not None and p + d_low > best[0]:
            break
        share = prefill(p)
        d_high = _first_meeting(lambda d: share * decode(d) >= target, d_low, d_high)
        candidate = (p + d_high, abs(p - current.prefill) + abs(d_high - current.decode), p, d_high)
        best = candidate if best is None else min(best, candidate)
        if d_high == d_low:
            break
    return Allocation(best[2], best[3])


def _best_effort(attainment: Callable[[int], float], utilisation: Callable[[int], float], bounds: PoolBounds,
                 tolerance: float) -> int:
    """The pool's count when the target is out of reach: goodput grows with replicas, so the fewest within
    `tolerance` of the attainment at max_replicas; max_replicas itself while even that is overloaded (its
    attainment is 0, yet every replica drains the queue faster)."""
    if utilisation(bounds.max_replicas) >= 1:
        return bounds.max_replicas
    floor = (1 - tolerance) * attainment(bounds.max_replicas)
    return _first_meeting(lambda n: attainment(n) >= floor, bounds.min_replicas, bounds.max_replicas)


@dataclass(frozen=True, eq=False)
class PoolView:
    """What the policy needs to know about one pool this tick."""

    role: Role
    bounds: PoolBounds
    current: int
    """Routable + starting replicas (starting ones are already provisioned)."""
    wish: int
    """The search's count for the attainment target (or the best-effort count)."""
    unreachable: bool
    """The target is out of reach and this pool sits at max_replicas in the best effort."""
    wish_down: int | None
    """The search's count for target + scale_down_margin (None: out of reach)."""
    memory: PoolMemory
    describe: Callable[[int], str]
    """Predicted numbers at n replicas, for reasons."""


def _targets(config: PlannerConfig, tuning: PlannerTuning, state: PlannerState, observation: Observation,
             prefill_pool: PrefixScaledPrefillPool, decode_pool: DecodePool) -> tuple[PoolOutcome, PoolOutcome]:
    """Search, then apply the policy to each pool: (prefill, decode)."""
    prefill_attainment, decode_attainment = _memoised(prefill_pool.attainment), _memoised(decode_pool.attainment)
    current = Allocation(observation.prefill.replicas + observation.prefill.starting,
                         observation.decode.replicas + observation.decode.starting)
    bounds = (config.prefill, config.decode)
    wish = fewest_devices(prefill_attainment, decode_attainment, bounds, config.attainment, current)
    down = fewest_devices(prefill_attainment, decode_attainment, bounds,
                          min(config.attainment + config.scale_down_margin, 1.0), current)
    best_effort = wish or Allocation(
        _best_effort(prefill_attainment, prefill_pool.utilisation, config.prefill, tuning.best_effort_tolerance),
        _best_effort(decode_attainment, decode_pool.utilisation, config.decode, tuning.best_effort_tolerance))
    views = (
        PoolView(Role.PREFILL, config.prefill, current.prefill, best_effort.prefill,
                 wish is None and best_effort.prefill == config.prefill.max_replicas,
                 down.prefill if down else None, state.prefill,
                 _describer(prefill_pool, config.ttft_s)),
        PoolView(Role.DECODE, config.decode, current.decode, best_effort.decode,
                 wish is None and best_effort.decode == config.decode.max_replicas,
                 down.decode if down else None, state.decode,
                 _describer(decode_pool, config.itl_s)))
    prefill, decode = (pool_target(view, config, observation.now_s) for view in views)
    return prefill, decode


def _describer(pool: PrefixScaledPrefillPool | DecodePool, target_s: float) -> Callable[[int], str]:
    """n -> the pool's predicted numbers at n replicas and the load they are for."""
    return lambda n: f"{pool.forecast(n).summary(target_s)} at {pool.workload.arrival_rate:.3g} req/s"


def _memoised(function: Callable[[int], float]) -> Callable[[int], float]:
    """One evaluation per replica count within a tick (the searches revisit counts)."""
    cache: dict[int, float] = {}

    def lookup(replicas: int) -> float:
        if replicas not in cache:
            cache[replicas] = function(replicas)
        return cache[replicas]
    return lookup


def pool_target(view: PoolView, config: PlannerConfig, now_s: float) -> PoolOutcome:
    """The policy for one pool: its target with a reason, and its memory for the next tick."""
    wants_down = view.wish <= view.current and view.wish_down is not None and view.wish_down < view.current
    held = view.memory.scale_down_ticks + 1 if wants_down else 0
    replicas, reason = _within_bounds(view, *_policy(view, config, now_s, held))
    change = replicas - view.current
    memory = PoolMemory(now_s, 0) if change else PoolMemory(view.memory.last_change_s, held)
    return PoolOutcome(PoolTarget(view.role, replicas, change, reason), memory)


def _policy(view: PoolView, config: PlannerConfig, now_s: float, held: int) -> tuple[int, str]:
    if view.wish > view.current:
        return _scale_up(view, config, now_s)
    if held:
        return _scale_down(view, config, now_s, held)
    return view.current, _hold_reason(view, config)


def _cooling_for(memory: PoolMemory, cooldown_s: float, now_s: float) -> float | None:
    """Seconds since the pool's last change while that is under cooldown_s; None once expired (or never)."""
    if memory.last_change_s is None or now_s - memory.last_change_s >= cooldown_s:
        return None
    return now_s - memory.last_change_s


def _scale_up(view: PoolView, config: PlannerConfig, now_s: float) -> tuple[int, str]:
    name, current, wish = view.role.value, view.current, view.wish
    since = _cooling_for(view.memory, config.scale_up_cooldown_s, now_s)
    if since is not None:
        return current, (f"cooldown: {name} wants {current} -> {wish} but changed {since:.3g} s ago "
                         f"(scale_up_cooldown_s {config.scale_up_cooldown_s:g}); "
                         f"at {current}: {view.describe(current)}")
    target = min(wish, current + config.max_step)
    if view.unreachable:
        top = view.bounds.max_replicas
        return target, (f"at_max: {name} {current} -> {target}: attainment {config.attainment:g} is out of reach "
                        f"even at max_replicas {top}; at {top}: {view.describe(top)}")
    if target < wish:
        return target, (f"bounded_step: {name} {current} -> {target} toward {wish} (max_step {config.max_step}); "
                        f"at {current}: {view.describe(current)}")
    return target, (f"scale_up: {name} {current} -> {target} for attainment {config.attainment:g}; "
                    f"at {current}: {view.describe(current)}; at {target}: {view.describe(target)}")


def _scale_down(view: PoolView, config: PlannerConfig, now_s: float, held: int) -> tuple[int, str]:
    name, current, wish = view.role.value, view.current, view.wish_down
    goal = min(config.attainment + config.scale_down_margin, 1.0)
    if held < config.scale_down_ticks:
        return current, (f"hold: {name} {current} could go to {wish} (predicted to meet {goal:g}), held "
                         f"{held}/{config.scale_down_ticks} ticks; at {current}: {view.describe(current)}")
    since = _cooling_for(view.memory, config.scale_down_cooldown_s, now_s)
    if since is not None:
        return current, (f"cooldown: {name} could go {current} -> {wish} but changed {since:.3g} s ago "
                         f"(scale_down_cooldown_s {config.scale_down_cooldown_s:g})")
    target = max(wish, current - config.max_step)
    if target > wish:
        return target, (f"bounded_step: {name} {current} -> {target} toward {wish} (max_step {config.max_step}); "
                        f"at {target}: {view.describe(target)}")
    prefix = "at_min" if target == view.bounds.min_replicas else "scale_down"
    return target, (f"{prefix}: {name} {current} -> {target}, predicted to meet {goal:g} for {held} ticks; "
                    f"at {target}: {view.describe(target)}")


def _hold_reason(view: PoolView, config: PlannerConfig) -> str:
    name, current = view.role.value, view.current
    if view.unreachable:
        return (f"at_max: {name} at max_replicas {current}; attainment {config.attainment:g} is out of reach; "
                f"{view.describe(current)}")
    if current == view.bounds.min_replicas:
        return f"at_min: {name} at min_replicas {current}; {view.describe(current)}"
    goal = min(config.attainment + config.scale_down_margin, 1.0)
    down = f"{view.wish_down} meet {goal:g}" if view.wish_down is not None else f"{goal:g} is out of reach"
    return f"hold: {name} {current}: {view.wish} meet {config.attainment:g}, {down}; {view.describe(current)}"


def _within_bounds(view: PoolView, replicas: int, reason: str) -> tuple[int, str]:
    """Bounds are hard: a pool outside them (the bounds changed) returns at once, past cooldowns and steps."""
    low, high = view.bounds.min_replicas, view.bounds.max_replicas
    if replicas < low:
        return low, f"at_min: {view.role.value} {view.current} -> {low}, raised to min_replicas ({reason})"
    if replicas > high:
        return high, f"at_max: {view.role.value} {view.current} -> {high}, lowered to max_replicas ({reason})"
    return replicas, reason


def local_prefill_threshold(model: PerformanceModel, decode_pool: DecodePool, decode_replicas: int,
                            itl_target_s: float, latency_scale: float) -> int:
    """The largest uncached prompt length (<= the prefill token budget) whose prefill, riding in one decode
    step at the pool's p99 batch, keeps that step within the ITL target; 0 when nothing fits."""
    slack = itl_target_s - decode_pool.itl_quantile_s(decode_replicas)
    if not slack > 0:
        return 0
    budget = model.prefill_token_budget

    def fits(tokens: int) -> bool:  # monotone: the stall grows with the prompt
        return model.local_prefill_stall_s(tokens) * latency_scale <= slack

    if fits(budget):
        return budget
    return _first_meeting(lambda n: not fits(n), 0, budget) - 1


def _prediction(prefill_pool: PrefixScaledPrefillPool, decode_pool: DecodePool, chosen: Allocation,
                rate: float) -> Prediction:
    attainment = prefill_pool.attainment(chosen.prefill) * decode_pool.attainment(chosen.decode)
    return Prediction(chosen.prefill, chosen.decode, prefill_pool.ttft_quantile_s(chosen.prefill),
                      decode_pool.itl_quantile_s(chosen.decode), attainment, rate * attainment)
