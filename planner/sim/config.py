"""The simulated cluster's configuration and goodput targets."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.validation import require
from splitserve.planner.core.types import PerformanceProfile


@dataclass(frozen=True)
class SimulatedCluster:
    """The simulated cluster and its goodput targets."""

    profile: PerformanceProfile = field(default_factory=PerformanceProfile)
    """Ground truth of every device's step times (DeviceModel), batch limit and prefill token budget."""
    ttft_s: float = 1.0
    """TTFT target of goodput (seconds)."""
    tpot_s: float = 0.05
    """TPOT target of goodput (seconds per output token after the first)."""
    initial_prefill: int = 1
    """Prefill replicas routable at time 0."""
    initial_decode: int = 1
    tick_s: float = 10.0
    """Seconds between the policy's decisions (and the observation window)."""
    scale_up_s: float = 30.0
    """Seconds from asking for a replica to it being routable."""
    decode_kv_tokens: int = 262_144
    """KV tokens one decode worker holds."""
    prefix_cache_groups: int = 8
    """Prefix groups (tenants' shared prompts) one prefill worker's LRU cache keeps (8 prompts of
    ~1.5k tokens: ~150 MB of KV for the 88M bench model, beside its in-flight requests)."""
    kv_bytes_per_token: int = 12_288
    """KV bytes of one token (12 layers x K and V x 4 KV heads x 64 dims x bf16: the 88M bench model)."""
    transfer_bytes_per_s: float = 4e9
    """KV transfer bandwidth (NIXL over UCX shared memory measured 3.7-5.0 GB/s here)."""
    transfer_latency_s: float = 0.0005
    router_scan_limit: int = 8
    """Pools with at most this many routable workers are scanned whole (larger: balance.LeastLoaded)."""
    step_samples: int = 32
    """Recent step samples per role in each observation."""
    histogram_bin_tokens: int = 16
    """Observed length histograms count lengths rounded up to this many tokens (1 = exact)."""
    overtime_s: float = 900.0
    """The run stops at the latest this long after the trace's duration."""

    def __post_init__(self) -> None:
        require(self.ttft_s > 0 and self.tpot_s > 0, "ttft_s and tpot_s must be > 0")
        require(self.initial_prefill >= 0 and self.initial_decode >= 0, "initial replica counts must be >= 0")
        require(self.tick_s > 0 and self.scale_up_s >= 0 and self.overtime_s >= 0,
                "need tick_s > 0, scale_up_s >= 0, overtime_s >= 0")
        require(self.decode_kv_tokens >= 1 and self.prefix_cache_groups >= 0, "need decode_kv_tokens >= 1")
        require(self.kv_bytes_per_token >= 0 and self.transfer_bytes_per_s > 0 and self.transfer_latency_s >= 0,
                "transfer parameters must be >= 0 (bandwidth > 0)")
        require(self.router_scan_limit >= 0, "router_scan_limit must be >= 0")
        require(self.step_samples >= 0 and self.histogram_bin_tokens >= 1, "need histogram_bin_tokens >= 1")
