//! `tl bench`: quick benchmarks that print one JSON line. Figures are ratios against baselines
//! measured in the same run, interleaved, because absolute speeds on a shared machine drift.

pub mod control;
pub mod goodput;
pub mod model;
pub mod peer;
pub mod peers;
pub mod route;
pub mod serve;
pub mod stats;
pub mod tenants;
pub mod transfer;
pub mod ttft;
pub mod wire;

use std::time::{Duration, Instant};

/// Whatever stopped a bench; printed to stderr with exit status 1.
pub(crate) type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Runs `f` repeatedly for about `budget` and returns GB/s for `bytes` per call.
pub(crate) fn gbps(bytes: usize, budget: Duration, mut f: impl FnMut()) -> f64 {
    // Calibrate the batch so clock reads are negligible.
    let mut batch = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            f();
        }
        if t.elapsed() >= Duration::from_millis(2) || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget {
        for _ in 0..batch {
            f();
        }
        calls += batch;
    }
    (bytes as f64 * calls as f64) / start.elapsed().as_secs_f64() / 1e9
}

/// The median of `v` (which it sorts).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(crate) fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1e3)
}

/// Span export switched on mid-run (the runs before it are the baseline): an OTLP receiver in
/// this process, the exporter sending to it.
pub(crate) struct Tracing {
    receiver: tl_engine::telemetry::receiver::Receiver,
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::Tracer,
    /// The receiver's own runtime: a collector is another process, not the measured one's
    /// workers.
    collector: Option<tokio::runtime::Runtime>,
}

impl Tracing {
    /// Starts the receiver and turns export on.
    pub(crate) async fn start() -> Result<Self, BenchError> {
        let collector = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let receiver = tl_engine::telemetry::receiver::Receiver::start_on(collector.handle())?;
        let endpoint = receiver.addr().to_string();
        // The exporter owns a runtime of its own: build it off this one.
        let (tracer, provider) = std::thread::spawn(move || {
            tl_engine::telemetry::export::otlp(&endpoint, "tl-bench", "bench")
        })
        .join()
        .map_err(|_| "the exporter thread panicked")??;
        if !tl_engine::telemetry::enable_spans(tracer.clone()) {
            return Err("span export could not be switched on".into());
        }
        tl_engine::telemetry::disable_spans();
        Ok(Self {
            receiver,
            provider,
            tracer,
            collector: Some(collector),
        })
    }

    /// Runs `f` with span export on, then switches it off again.
    pub(crate) async fn traced<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        tl_engine::telemetry::enable_spans(self.tracer.clone());
        let out = f.await;
        tl_engine::telemetry::disable_spans();
        out
    }

    /// Flushes and stops export; returns the spans received and those the exporter dropped.
    pub(crate) async fn finish(mut self) -> serde_json::Value {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || {
            let _ = provider.force_flush();
            let _ = provider.shutdown();
        })
        .await;
        if let Some(rt) = self.collector.take() {
            rt.shutdown_background();
        }
        serde_json::json!({
            "spans_received": self.receiver.spans().len(),
            "spans_dropped": tl_engine::telemetry::export::spans_dropped(),
            "exporter": "OTLP/gRPC to an in-process receiver, batches of up to 512 every 200 ms",
        })
    }
}

/// The CPU a figure was measured on, from `/proc/cpuinfo`: model name, family, model, cores and
/// the flags the hot paths depend on (every figure names its CPU class).
/// The kernel a figure was measured on, as far as it tells an unprivileged reader: its release
/// and build line, its preemption model (from debugfs when readable, else a `preempt=` boot
/// parameter, else unknown), and whether it runs under a hypervisor. Tail latencies depend on
/// these as much as on the CPU: a `PREEMPT_NONE` kernel runs a syscall to its end before a
/// woken thread gets the core.
pub(crate) fn kernel_json() -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).ok();
    let preempt = read("/sys/kernel/debug/sched/preempt")
        .and_then(|s| current_preempt(&s))
        .map(|m| format!("{m} (debugfs)"))
        .or_else(|| {
            read("/proc/cmdline")?.split_whitespace().find_map(|w| {
                w.strip_prefix("preempt=")
                    .map(|m| format!("{m} (boot line)"))
            })
        });
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let guest = flags
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "hypervisor"));
    serde_json::json!({
        "release": read("/proc/sys/kernel/osrelease"),
        "build": read("/proc/sys/kernel/version"),
        "preempt": preempt,
        "guest": guest,
    })
}

/// The current model in debugfs's `sched/preempt`, which lists them all with the current one in
/// parentheses: "none voluntary (full) lazy".
fn current_preempt(listing: &str) -> Option<String> {
    listing
        .split_whitespace()
        .find(|w| w.starts_with('(') && w.ends_with(')'))
        .map(|w| w.trim_matches(|c| c == '(' || c == ')').to_owned())
}

pub(crate) fn cpu_json() -> serde_json::Value {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|n| n.trim() == k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let have: Vec<&str> = [
        "avx2",
        "avx512f",
        "vaes",
        "vpclmulqdq",
        "sha_ni",
        "erms",
        "fsrm",
    ]
    .into_iter()
    .filter(|f| flags.split_whitespace().any(|x| x == *f))
    .collect();
    serde_json::json!({
        "model_name": field("model name"),
        "family": field("cpu family"),
        "model": field("model"),
        "cores": std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        "flags": have,
        "memcpy": tl_engine::copies::state_json(),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_current_preemption_model_is_the_one_in_parentheses() {
        assert_eq!(
            super::current_preempt("none voluntary (full) lazy").as_deref(),
            Some("full")
        );
        assert_eq!(
            super::current_preempt("(none) voluntary full").as_deref(),
            Some("none")
        );
        assert_eq!(super::current_preempt("none voluntary full"), None);
    }

    #[test]
    fn the_kernel_names_its_release() {
        let k = super::kernel_json();
        let release = k["release"].as_str().unwrap_or_default();
        assert!(
            release.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "{k}"
        );
        assert!(k["guest"].is_boolean(), "{k}");
    }
}
